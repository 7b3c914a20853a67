"""GGUF model settings: which file a setting names, and the dequantized directory made once beside it, again
only when the file is replaced. (The conversion itself is checked on SmolLM2's file in
tests/contract/test_smollm2_pair.py.)"""

from __future__ import annotations

import json
import os
import threading

import pytest

from specdec.engine import gguf_checkpoint
from specdec.engine.gguf_checkpoint import dequantized_dir, gguf_path, resolve_model


def test_a_setting_names_a_gguf_file_by_its_suffix_or_as_a_file_in_a_directory(tmp_path):
    (tmp_path / "m.GGUF").write_bytes(b"x")
    (tmp_path / "q.gguf").write_bytes(b"x")
    assert gguf_path(str(tmp_path / "m.GGUF")) == tmp_path / "m.GGUF"
    assert gguf_path(str(tmp_path), "q.gguf") == tmp_path / "q.gguf"
    assert gguf_path(str(tmp_path)) is None and gguf_path("org/name") is None
    assert resolve_model("org/name") == "org/name"
    assert dequantized_dir(tmp_path / "q.gguf") == tmp_path / "q.dequantized"


def test_a_named_gguf_file_that_is_missing_is_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        resolve_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="other.gguf"):
        resolve_model(str(tmp_path), "other.gguf")


@pytest.fixture
def conversions(monkeypatch) -> list[str]:
    """Records each conversion; a conversion writes the file's bytes as its only output."""
    done: list[str] = []

    def save(gguf, out_dir):
        out_dir.mkdir()
        (out_dir / "weights").write_bytes(gguf.read_bytes())
        done.append(gguf.read_text())

    monkeypatch.setattr(gguf_checkpoint, "save_dequantized", save)
    return done


def test_a_file_is_converted_once_and_again_only_when_its_content_changes(tmp_path, conversions):
    gguf = tmp_path / "model.gguf"
    gguf.write_text("v1")
    out = resolve_model(str(gguf))
    assert resolve_model(str(gguf)) == out and conversions == ["v1"]
    os.utime(gguf, ns=(1, 1))  # touched, same bytes: the SHA-256 decides, no conversion
    assert resolve_model(str(gguf)) == out and conversions == ["v1"]
    gguf.write_text("v2")
    resolve_model(str(gguf))
    assert conversions == ["v1", "v2"] and (dequantized_dir(gguf) / "weights").read_text() == "v2"
    marker = json.loads((dequantized_dir(gguf) / gguf_checkpoint.SOURCE_MARKER).read_text())
    assert marker["name"] == "model.gguf" and len(marker["sha256"]) == 64
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.dequantized", "model.gguf", "model.gguf.lock"]


def test_services_starting_at_once_convert_it_once(tmp_path, conversions):
    gguf = tmp_path / "model.gguf"
    gguf.write_text("v1")
    threads = [threading.Thread(target=resolve_model, args=(str(gguf),)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert conversions == ["v1"]


def test_a_failed_conversion_leaves_nothing_behind(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_text("not a gguf file")
    with pytest.raises((ValueError, OSError)):
        resolve_model(str(gguf))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "model.gguf.lock"]
