"""The demo corpus: the running interpreter's standard-library source, tests excluded, split by file."""

from __future__ import annotations

import hashlib
import pathlib
import sysconfig
from dataclasses import dataclass

HELD_OUT_PERCENT = 5
_TEST_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


@dataclass(frozen=True)
class CorpusFile:
    """One source file of the corpus: its path relative to the stdlib root and its text."""

    relative_path: str
    text: str


def stdlib_root() -> pathlib.Path:
    """The directory holding the running interpreter's standard-library source."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def _is_test_file(relative: pathlib.Path) -> bool:
    return any(part in _TEST_DIRS or part.startswith("test_") for part in relative.parts)


def is_held_out(relative_path: str) -> bool:
    """A stable, machine-independent split: a file is held out when its path hashes into the last 5%."""
    digest = hashlib.sha256(relative_path.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELD_OUT_PERCENT


def load_split(held_out: bool) -> list[CorpusFile]:
    """Every non-test stdlib `.py` file on one side of the split, sorted by path."""
    root = stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if _is_test_file(relative) or is_held_out(str(relative)) != held_out:
            continue
        files.append(CorpusFile(str(relative), path.read_text(encoding="utf-8", errors="replace")))
    return files
