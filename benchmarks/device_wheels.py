"""The serving packages a lent GPU machine lacks, as wheels to carry there, derived from requirements.txt.

The machine has torch, transformers and triton. The services also need what requirements.txt names for serving
(gRPC, its health and reflection services, protobuf, OpenTelemetry, Redis's client, dnspython, Prometheus' client,
Jinja), and those packages' own dependencies. The list is requirements.txt's names less what the machine has or the
stack does not start (ON_DEVICE, NOT_CARRIED), closed over their installed dependencies, each at the version
installed here: the versions the tests ran with, so grpcio is the one the generated stubs (specdec/v1) name.

    python -m benchmarks.device_wheels              # downloads the wheels into .whl/ (about 10 MB), for CPython 3.12
    python -m benchmarks.device_wheels --list       # prints name==version, one a line
"""

from __future__ import annotations

import argparse
import importlib.metadata
import pathlib
import subprocess
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
# what the GPU machine's image has (and the packages they bring)
ON_DEVICE = frozenset(
    canonicalize_name(name)
    for name in (
        "torch", "transformers", "tokenizers", "safetensors", "accelerate", "huggingface-hub", "triton", "numpy",
        "scipy", "typing-extensions", "packaging", "pyyaml", "filelock", "fsspec", "requests", "urllib3", "certifi",
        "idna", "charset-normalizer", "regex", "tqdm", "sympy", "mpmath", "networkx", "setuptools", "psutil",
    )
)  # fmt: skip
# named in requirements.txt but not needed to start the stack on one GPU (the OTLP exporter loads only when asked for)
NOT_CARRIED = frozenset(
    canonicalize_name(name)
    for name in ("ray", "grpcio-tools", "matplotlib", "ninja", "opentelemetry-exporter-otlp-proto-grpc")
)
DEVICE_PYTHON = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux"}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def requirement_names(path: pathlib.Path) -> list[str]:
    """The package names a requirements file lists (following -r includes)."""
    names = []
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("-r"):
            names += requirement_names(path.parent / line[2:].strip())
        elif line:
            names.append(Requirement(line).name)
    return names


def _applies(requirement: Requirement) -> bool:
    """Whether a dependency applies on the device's Python (no extras asked for)."""
    return requirement.marker is None or requirement.marker.evaluate({**DEVICE_PYTHON, "extra": ""})


def carried_packages(requirements: pathlib.Path = REPO_ROOT / "requirements.txt") -> dict[str, str]:
    """Canonical name -> installed version of every package to carry: requirements.txt's serving packages and
    their installed dependencies, less what the device has."""
    leave_out = ON_DEVICE | NOT_CARRIED
    queue = [canonicalize_name(name) for name in requirement_names(requirements)]
    carried: dict[str, str] = {}
    while queue:
        name = queue.pop()
        if name in carried or name in leave_out:
            continue
        carried[name] = importlib.metadata.version(name)
        for line in importlib.metadata.requires(name) or []:
            requirement = Requirement(line)
            if _applies(requirement):
                queue.append(canonicalize_name(requirement.name))
    return dict(sorted(carried.items()))


def download_command(pins: list[str], dest: pathlib.Path) -> list[str]:
    """pip download of exactly these wheels for the device's Python and platform."""
    platforms = [flag for platform in PLATFORMS for flag in ("--platform", platform)]
    return [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
        DEVICE_PYTHON["python_version"], "--implementation", "cp", *platforms, "-d", str(dest), *pins,
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=pathlib.Path, default=REPO_ROOT / ".whl", help="where the wheels go")
    parser.add_argument("--list", action="store_true", help="print the pins, download nothing")
    args = parser.parse_args(argv)
    pins = [f"{name}=={version}" for name, version in carried_packages().items()]
    if args.list:
        print("\n".join(pins))
        return
    subprocess.run(download_command(pins, args.dest), check=True)
    print(f"{len(pins)} wheels in {args.dest}: carry it (run's `carry`) and install with --target (README)")


if __name__ == "__main__":
    main()
