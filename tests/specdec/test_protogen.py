"""The committed stubs in specdec/v1 are what protoc generates from protos/ now."""

from __future__ import annotations

from specdec.protogen import REPO_ROOT, STUB_PACKAGE, generate


def test_generated_stubs_are_fresh(tmp_path):
    fresh = generate(tmp_path)
    assert fresh, "protoc generated nothing"
    committed = sorted(p for p in (REPO_ROOT / STUB_PACKAGE).iterdir() if p.is_file() and p.name != "__init__.py")
    assert [p.name for p in committed] == [p.name for p in fresh], "stub files differ: run python -m specdec.protogen"
    for new in fresh:
        assert (REPO_ROOT / STUB_PACKAGE / new.name).read_bytes() == new.read_bytes(), (
            f"{new.name} is stale: run python -m specdec.protogen"
        )
