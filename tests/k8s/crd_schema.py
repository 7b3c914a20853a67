"""Validation of a custom resource against its CustomResourceDefinition's structural schema, as an API server with
strict field validation (kubectl 1.27 and newer: `--validate=strict`) would: a field the schema does not name is an
error unless the schema preserves unknown fields there. CEL rules (`x-kubernetes-validations`) are not evaluated."""

from __future__ import annotations

import copy
import functools
import gzip
import hashlib
import pathlib
import re

import jsonschema
import yaml

SCHEMAS = pathlib.Path(__file__).resolve().parent / "schemas"
# A row of schemas/README.md's table: | `FILE` | what | source | `SHA256` |
VENDORED_ROW = re.compile(r"^\| `(?P<file>[^`]+\.yaml\.gz)` \|.*\| `(?P<sha256>[0-9a-f]{64})` \|$", re.MULTILINE)


def load_crd(path: pathlib.Path, sha256: str) -> dict:
    """A vendored CRD (gzipped YAML), checked against the digest recorded beside it."""
    raw = gzip.decompress(path.read_bytes())
    digest = hashlib.sha256(raw).hexdigest()
    assert digest == sha256, f"{path.name}: sha256 {digest}, recorded {sha256}"
    return yaml.safe_load(raw)


@functools.cache
def vendored_crds() -> dict[str, tuple[str, dict]]:
    """Kind -> (the operator release it comes from, its CRD), for every file schemas/README.md lists (each checked
    against the digest recorded there); the file names say the release: OPERATOR-vX.Y.Z-NAME.yaml.gz."""
    rows = list(VENDORED_ROW.finditer((SCHEMAS / "README.md").read_text()))
    assert {row["file"] for row in rows} == {path.name for path in SCHEMAS.glob("*.gz")}, "schemas/README.md lags"
    crds = {}
    for row in rows:
        crd = load_crd(SCHEMAS / row["file"], row["sha256"])
        crds[crd["spec"]["names"]["kind"]] = (re.search(r"-(v\d+\.\d+\.\d+)-", row["file"]).group(1), crd)
    return crds


def strict(schema: dict) -> dict:
    """The schema with unknown fields refused wherever the CRD does not preserve them."""
    schema = copy.deepcopy(schema)

    def close(node: dict) -> None:
        if node.get("properties") is not None and not node.get("x-kubernetes-preserve-unknown-fields"):
            node.setdefault("additionalProperties", False)
        for child in node.get("properties", {}).values():
            close(child)
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                close(node[key])
        for key in ("allOf", "anyOf", "oneOf"):
            for child in node.get(key, []):
                close(child)

    close(schema)
    return schema


def validation_errors(crd: dict, obj: dict) -> list[str]:
    """Why the API server would refuse `obj` (empty when it accepts it)."""
    group, _, version = obj["apiVersion"].partition("/")
    if group != crd["spec"]["group"] or obj["kind"] != crd["spec"]["names"]["kind"]:
        return [f"{obj['apiVersion']} {obj['kind']} is not what {crd['metadata']['name']} defines"]
    served = {v["name"]: v for v in crd["spec"]["versions"] if v.get("served")}
    if version not in served:
        return [f"{obj['apiVersion']}: the CRD serves {sorted(served)}"]
    validator = jsonschema.Draft7Validator(strict(served[version]["schema"]["openAPIV3Schema"]))
    return [
        f"{'.'.join(str(p) for p in error.absolute_path) or '(top)'}: {error.message}"
        for error in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))
    ]
