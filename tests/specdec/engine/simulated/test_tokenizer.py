"""The twin's tokenizer: the served vocabulary's size, code tokenized as on the demo pair, built once per size."""

from __future__ import annotations

from transformers import AutoTokenizer

from specdec.engine.embedded_pair import DEMO_TARGET_DIR
from specdec.engine.model_runtime import tokenizer_sha256
from specdec.engine.simulated.tokenizer import (
    build_tokenizer,
    load_twin_tokenizer,
    tokenizer_source,
    twin_tokenizer_dir,
)

CODE = "def fibonacci(n):\n    return n"


def test_it_serves_the_vocabulary_and_reads_code_as_the_demo_pair(twin_cache):
    tokenizer = load_twin_tokenizer(32768)
    demo = AutoTokenizer.from_pretrained(DEMO_TARGET_DIR)
    assert len(tokenizer) == 32768
    assert tokenizer(CODE)["input_ids"] == demo(CODE)["input_ids"]
    assert tokenizer.eos_token_id == demo.eos_token_id == 0
    assert tokenizer.decode([*demo(CODE)["input_ids"], 30000]) == CODE + "<t30000>"


def test_it_is_built_once_and_the_same_every_time(twin_cache):
    folder = twin_tokenizer_dir(16384)
    stamp = (folder / "tokenizer.json").stat().st_mtime_ns
    assert twin_tokenizer_dir(16384) == folder
    assert (folder / "tokenizer.json").stat().st_mtime_ns == stamp
    assert tokenizer_sha256(load_twin_tokenizer(16384)) == tokenizer_sha256(build_tokenizer(16384))


def test_a_coordinator_names_it_by_the_twin_device(twin_cache):
    assert tokenizer_source("sim:llama8b-h100:16384") == str(twin_tokenizer_dir(16384))
    assert tokenizer_source("models/demo-target") == "models/demo-target"
