"""Naming a twin device: `sim:PROFILE[:VOCAB]`, refused with the field named when it names nothing served."""

from __future__ import annotations

import pytest

from specdec.engine.simulated.profiles import parse_twin_device


def test_a_profile_alone_serves_its_whole_vocabulary():
    twin = parse_twin_device("sim:llama70b-tp4-h100")
    assert twin.served_vocab == 128256
    assert twin.spec == "sim:llama70b-tp4-h100:128256"
    assert parse_twin_device("sim:llama8b-h100:8192").served_vocab == 8192


@pytest.mark.parametrize(
    "device, message",
    [
        ("cuda:0", "not a twin device"),
        ("sim:llama13b", "unknown twin profile 'llama13b'"),
        ("sim:llama8b-h100:many", "must be an integer"),
        ("sim:llama8b-h100:100", r"must lie in \[8192, 128256\]"),
        ("sim:llama8b-h100:200000", "must lie in"),
    ],
)
def test_bad_devices_are_refused_naming_the_field(device, message):
    with pytest.raises(ValueError, match=f"^tokenizer: .*{message}"):
        parse_twin_device(device, "tokenizer")
