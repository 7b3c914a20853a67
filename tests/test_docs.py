"""The README and docs stay readable, and every report they link to exists."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
RESULT_INDEXES = [ROOT / "load_tests/results/README.md", ROOT / "benchmarks/results/README.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")  # [text](target)
MAX_README_CHARS = 12_000
MAX_TABLE_CELL_CHARS = 400
MAX_LOAD_TEST_RESULT_FILES = 60


def local_links(page: pathlib.Path) -> list[str]:
    """The page's link targets that point into the repository (no URLs, no in-page anchors)."""
    targets = [target.split("#")[0] for target in LINK.findall(page.read_text())]
    return [target for target in targets if target and not re.match(r"[a-z]+:", target)]


def test_readme_is_short_and_its_table_cells_too():
    text = README.read_text()
    assert len(text) <= MAX_README_CHARS
    cells = [cell for line in text.splitlines() if line.startswith("|") for cell in line.split("|")]
    assert max(len(cell) for cell in cells) <= MAX_TABLE_CELL_CHARS


def test_the_docs_the_readme_promises_exist():
    names = {page.name for page in DOCS}
    assert {"architecture.md", "glossary.md", "operations.md", "results.md"} <= names


@pytest.mark.parametrize("page", [README, *DOCS, *RESULT_INDEXES], ids=lambda page: str(page.relative_to(ROOT)))
def test_every_linked_file_exists(page):
    missing = [target for target in local_links(page) if not (page.parent / target).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"


def test_load_test_results_stay_few_and_indexed():
    files = [path for path in (ROOT / "load_tests/results").rglob("*") if path.is_file()]
    tracked = [path for path in files if "latest" not in path.relative_to(ROOT / "load_tests/results").parts]
    assert len(tracked) <= MAX_LOAD_TEST_RESULT_FILES
    index = (ROOT / "load_tests/results/README.md").read_text()
    for report in (ROOT / "load_tests/results").glob("*/*/"):
        assert str(report.relative_to(ROOT / "load_tests/results")) in index, f"{report} is not in the index"


def test_nothing_points_at_issue_numbers():
    """Issues live outside the repository: code and docs link to docs/ instead."""
    kinds = ("*.py", "*.md", "*.yaml", "*.cpp", "*.sh")
    skipped = {".venv", "models", "results", ".git"}
    pages = [path for kind in kinds for path in ROOT.rglob(kind) if not skipped & set(path.relative_to(ROOT).parts)]
    pattern = re.compile(r"\bissues? #?\d+", re.IGNORECASE)
    offenders = [f"{path.relative_to(ROOT)}: {match}" for path in pages for match in pattern.findall(path.read_text())]
    assert not offenders
