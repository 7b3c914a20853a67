"""scripts/fetch_model.py, which the Kubernetes models Job runs: local file:// sources and an HTTP tarball
served from loopback, the swap into place, running again, and what it refuses."""

from __future__ import annotations

import functools
import http.server
import importlib.util
import io
import os
import pathlib
import re
import tarfile
import tempfile
import threading

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "fetch_model.py"
spec = importlib.util.spec_from_file_location("fetch_model", SCRIPT)
fetch_model = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fetch_model)


def make_model(directory: pathlib.Path, marker: str = "a") -> pathlib.Path:
    (directory / "sub").mkdir(parents=True)
    (directory / "config.json").write_text('{"model_type": "tiny"}')
    (directory / "model.safetensors").write_bytes(marker.encode() * 1000)
    (directory / "sub" / "tokenizer.json").write_text(marker)
    return directory


def make_tarball(path: pathlib.Path, source: pathlib.Path, top: str = "") -> pathlib.Path:
    with tarfile.open(path, "w:gz") as archive:
        archive.add(source, arcname=top or ".")
    return path


def files_of(directory: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_directory_is_copied_once_and_marked(tmp_path):
    source = make_model(tmp_path / "source")
    dest = tmp_path / "models" / "target"
    assert fetch_model.main([source.as_uri(), str(dest)]) == 0
    copied = files_of(dest)
    assert copied.pop(fetch_model.SOURCE_FILE).decode().strip() == source.as_uri()
    assert copied == files_of(source)
    (dest / "config.json").write_text("touched")  # a second run with the same URI leaves it alone
    assert fetch_model.fetch_model(source.as_uri(), dest) is False
    assert (dest / "config.json").read_text() == "touched"
    assert sorted(p.name for p in dest.parent.iterdir()) == ["target"]  # nothing left beside it


@pytest.mark.parametrize("top", ["", "my-model"])
def test_a_tarball_is_unpacked_from_inside_its_one_directory(tmp_path, top):
    source = make_model(tmp_path / "source")
    tarball = make_tarball(tmp_path / "model.tar.gz", source, top)
    dest = tmp_path / "target"
    assert fetch_model.fetch_model(tarball.as_uri(), dest) is True
    assert {k: v for k, v in files_of(dest).items() if k != fetch_model.SOURCE_FILE} == files_of(source)


def test_a_new_uri_replaces_the_model_whole(tmp_path):
    dest = tmp_path / "target"
    fetch_model.fetch_model(make_model(tmp_path / "v1", "a").as_uri(), dest)
    (tmp_path / "v2").mkdir()
    (tmp_path / "v2" / "config.json").write_text("{}")
    assert fetch_model.fetch_model((tmp_path / "v2").as_uri(), dest) is True
    assert sorted(files_of(dest)) == [fetch_model.SOURCE_FILE, "config.json"]  # no file of v1 survives


def test_an_http_tarball_is_streamed(tmp_path):
    (tmp_path / "served").mkdir()
    make_tarball(tmp_path / "served" / "model.tgz", make_model(tmp_path / "source"), "m")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path / "served"))
    handler.log_message = lambda *args: None
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        base = f"http://127.0.0.1:{server.server_address[1]}"
        try:
            assert fetch_model.fetch_model(f"{base}/model.tgz", tmp_path / "target") is True
            with pytest.raises(fetch_model.FetchError, match="404"):
                fetch_model.fetch_model(f"{base}/missing.tgz", tmp_path / "other")
        finally:
            server.shutdown()
    assert (tmp_path / "target" / "sub" / "tokenizer.json").read_text() == "a"
    assert not (tmp_path / "other").exists() and not (tmp_path / "other.incoming").exists()


def test_refuses_what_is_no_model_or_escapes_it(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(fetch_model.FetchError, match="config.json"):
        fetch_model.fetch_model((tmp_path / "empty").as_uri(), tmp_path / "target")
    assert not (tmp_path / "target").exists()
    escaping = tmp_path / "evil.tar"
    with tarfile.open(escaping, "w") as archive:
        info = tarfile.TarInfo("../outside.txt")
        info.size = 3
        archive.addfile(info, io.BytesIO(b"bad"))
    with pytest.raises(fetch_model.FetchError, match="outside"):
        fetch_model.fetch_model(escaping.as_uri(), tmp_path / "target")
    assert not (tmp_path / "outside.txt").exists()
    with pytest.raises(fetch_model.FetchError, match="unknown scheme"):
        fetch_model.fetch_model("ftp://host/model.tar", tmp_path / "target")
    assert fetch_model.main([(tmp_path / "nothing").as_uri(), str(tmp_path / "target")]) == 1


def refusal(volume: pathlib.Path, source: pathlib.Path) -> str:
    """fetch_model's error for a volume it may not write, as the Job's non-root user meets it: as root, the
    volume stays root-owned 0755 (a fresh GKE Filestore share) and a forked child drops to uid 10001 first."""
    uri = f"file://{source}"
    if os.getuid() != 0:
        volume.chmod(0o555)
        with pytest.raises(fetch_model.FetchError) as raised:
            fetch_model.fetch_model(uri, volume / "target")
        return str(raised.value)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        os.close(read)
        try:
            os.setgroups([])
            os.setgid(10001)
            os.setuid(10001)
            fetch_model.fetch_model(uri, volume / "target")
            message = "fetched"
        except BaseException as error:  # noqa: BLE001 - whatever it was goes back to the test
            message = str(error)
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        message = pipe.read()
    os.waitpid(child, 0)
    return message


def test_a_volume_it_may_not_write_is_refused_naming_its_owner_and_mode():
    """A fresh RWX share whose driver ignores fsGroup fails at once, saying who owns it and how to fix it."""
    with tempfile.TemporaryDirectory() as scratch:  # under /tmp, which every user may traverse
        root = pathlib.Path(scratch)
        root.chmod(0o755)
        volume, source = root / "models", make_model(root / "source")
        volume.mkdir()
        volume.chmod(0o755)
        message = refusal(volume, source)
        pattern = r"models is not writable by uid \d+ .* owned by \d+:\d+ with mode 0[57]55"
        assert re.search(pattern, message), message
        assert "Model weights" in message and not (volume / "target").exists()
