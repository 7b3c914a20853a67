"""GGUF models: dequantized once into a safetensors model directory beside the file, then loaded as any directory.

transformers reads a GGUF file (with the `gguf` package) into a float model, tokenizer and chat template included,
but dequantizing every tensor takes tens of seconds on a CPU. The first start that names a GGUF file saves the
result next to it (`NAME.gguf` -> `NAME.dequantized/`: config, float32 safetensors, tokenizer, generation config)
under a file lock, so two services starting at once convert it once; later starts load that directory. A marker
in it records the file's size, mtime and SHA-256: a GGUF file replaced by another is converted again
(docs/architecture.md, "Models served, and the start-up self-test").
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import pathlib
import shutil
import time
from collections.abc import Iterator

import torch

log = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"
DEQUANTIZED_SUFFIX = ".dequantized"
SOURCE_MARKER = "gguf-source.json"  # in the dequantized directory: which file it was made from


def gguf_path(model: str, gguf_file: str = "") -> pathlib.Path | None:
    """The GGUF file a model setting names: `model` itself when it ends in .gguf, `model/gguf_file` when
    `gguf_file` is set; None for an ordinary model directory or hub id. Raises FileNotFoundError for a named
    GGUF file that is not there."""
    if gguf_file:
        path = pathlib.Path(model) / gguf_file
    elif model.lower().endswith(GGUF_SUFFIX):
        path = pathlib.Path(model)
    else:
        return None
    if not path.is_file():
        raise FileNotFoundError(f"GGUF model file {path} does not exist")
    return path


def dequantized_dir(gguf: pathlib.Path) -> pathlib.Path:
    """Where a GGUF file's dequantized copy lives: beside it, `NAME.dequantized/`."""
    return gguf.with_name(gguf.name[: -len(GGUF_SUFFIX)] + DEQUANTIZED_SUFFIX)


def resolve_model(model: str, gguf_file: str = "") -> str:
    """The model directory (or hub id) to load for a model setting: `model` unchanged unless it names a GGUF file,
    whose dequantized directory is made on first use and returned."""
    gguf = gguf_path(model, gguf_file)
    if gguf is None:
        return model
    return str(ensure_dequantized(gguf))


def _file_stamp(path: pathlib.Path) -> dict:
    stat = path.stat()
    return {"name": path.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _is_current(out_dir: pathlib.Path, gguf: pathlib.Path) -> bool:
    """Whether out_dir holds a complete conversion of this very file: same size and mtime, else same SHA-256."""
    marker = out_dir / SOURCE_MARKER
    if not marker.is_file():
        return False
    recorded = json.loads(marker.read_text())
    stamp = _file_stamp(gguf)
    if all(recorded.get(key) == value for key, value in stamp.items()):
        return True
    return recorded.get("size") == stamp["size"] and recorded.get("sha256") == _sha256(gguf)


@contextlib.contextmanager
def _locked(path: pathlib.Path) -> Iterator[None]:
    with open(path, "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def ensure_dequantized(gguf: pathlib.Path) -> pathlib.Path:
    """The dequantized directory of `gguf`, converted now unless a current one exists."""
    out_dir = dequantized_dir(gguf)
    if _is_current(out_dir, gguf):
        return out_dir
    with _locked(gguf.with_name(gguf.name + ".lock")):
        if not _is_current(out_dir, gguf):  # another process may have converted it while this one waited
            dequantize(gguf, out_dir)
    return out_dir


def dequantize(gguf: pathlib.Path, out_dir: pathlib.Path) -> None:
    """Converts `gguf` into a model directory at out_dir, replacing what was there only once the new one is complete
    (with its source marker)."""
    started = time.perf_counter()
    log.info("dequantizing %s into %s (once) ...", gguf, out_dir)
    incoming = out_dir.with_name(out_dir.name + f".incoming-{os.getpid()}")
    shutil.rmtree(incoming, ignore_errors=True)
    try:
        save_dequantized(gguf, incoming)
        (incoming / SOURCE_MARKER).write_text(json.dumps({**_file_stamp(gguf), "sha256": _sha256(gguf)}, indent=1))
        shutil.rmtree(out_dir, ignore_errors=True)
        incoming.rename(out_dir)
    finally:
        shutil.rmtree(incoming, ignore_errors=True)
    log.info("dequantized %s in %.1fs", gguf.name, time.perf_counter() - started)


def save_dequantized(gguf: pathlib.Path, out_dir: pathlib.Path) -> None:
    """Loads `gguf` through transformers (float32 weights, tokenizer, chat template) and saves it as an ordinary
    model directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are plain floats now: drop the GGUF quantizer, which refuses to save, and its config entry.
    model.hf_quantizer = None
    model.is_quantized = False
    vars(model.config).pop("quantization_config", None)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
