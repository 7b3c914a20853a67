"""The wheels carried to a GPU machine come from requirements.txt at the versions installed here: grpcio is the one
the generated stubs were made for, and nothing the machine has (torch, transformers) is carried."""

from __future__ import annotations

import importlib.metadata

from benchmarks import device_wheels
from specdec.v1 import common_pb2_grpc


def test_the_carried_packages_are_the_serving_requirements_at_their_installed_versions():
    carried = device_wheels.carried_packages()
    assert carried["grpcio"] == common_pb2_grpc.GRPC_GENERATED_VERSION == importlib.metadata.version("grpcio")
    for name in ("protobuf", "grpcio-health-checking", "grpcio-reflection", "opentelemetry-sdk", "redis", "dnspython"):
        assert carried[name] == importlib.metadata.version(name)
    assert "opentelemetry-semantic-conventions" in carried, "a dependency requirements.txt does not name"
    assert not set(carried) & (device_wheels.ON_DEVICE | device_wheels.NOT_CARRIED)
    named = {
        name
        for name in map(
            device_wheels.canonicalize_name,
            device_wheels.requirement_names(device_wheels.REPO_ROOT / "requirements.txt"),
        )
    }
    assert named - device_wheels.ON_DEVICE - device_wheels.NOT_CARRIED <= set(carried)


def test_the_download_asks_for_exactly_those_wheels_for_the_devices_python():
    command = device_wheels.download_command(["grpcio==1.85.4"], device_wheels.REPO_ROOT / ".whl")
    assert command[-1] == "grpcio==1.85.4" and "--no-deps" in command and "--only-binary=:all:" in command
    assert command[command.index("--python-version") + 1] == "3.12"
