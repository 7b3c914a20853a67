"""Generates the Python stubs of `protos/` into `specdec/v1/` (run after editing a .proto).

python -m specdec.protogen            # regenerate in place
python -m specdec.protogen --out DIR  # generate elsewhere (the freshness test compares the two)
"""

from __future__ import annotations

import argparse
import pathlib

import grpc_tools
from grpc_tools import protoc

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
STUB_PACKAGE = "specdec/v1"


def proto_files() -> list[pathlib.Path]:
    """Every .proto of the contract, sorted."""
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Runs protoc (messages, gRPC stubs, type stubs) into out_dir; returns the generated files."""
    (out_dir / STUB_PACKAGE).mkdir(parents=True, exist_ok=True)
    well_known = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    return sorted(p for p in (out_dir / STUB_PACKAGE).iterdir() if p.name != "__init__.py" and p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=REPO_ROOT)
    for path in generate(parser.parse_args().out):
        print(path)


if __name__ == "__main__":
    main()
