"""Where the twin keeps what it builds once per machine (tokenizers, draft calibrations): a folder under the user's
cache (`$XDG_CACHE_HOME/specdec/twin`, else `~/.cache/specdec/twin`). Entries are written whole and renamed into
place, so services starting side by side never see half of one."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable


def twin_cache_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "specdec" / "twin"


def cached_folder(name: str, build: Callable[[pathlib.Path], None]) -> pathlib.Path:
    """The cache folder `name`, built by `build(folder)` into a fresh folder first if it is not there yet."""
    target = twin_cache_dir() / name
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        scratch = pathlib.Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
        try:
            build(scratch)
            os.rename(scratch, target)
        except OSError:
            if not target.exists():
                raise
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return target


def cached_value(name: str, compute: Callable[[], float]) -> float:
    """A number kept in the cache file `name` (JSON), computed by `compute()` the first time."""
    path = twin_cache_dir() / f"{name}.json"
    if path.exists():
        return float(json.loads(path.read_text())["value"])
    value = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(f".{os.getpid()}.tmp")
    scratch.write_text(json.dumps({"value": value}))
    os.replace(scratch, path)
    return value
