"""The draft's JSON training data: requests that name their schema's fields, and a teacher's continuations under
constraints (valid JSON that fits each row's schema, batched rows written as alone, the unmasked distribution
recorded over the allowed ids first). A tiny random teacher on the demo pair's tokenizer stands in for SmolLM2."""

from __future__ import annotations

import json
import pathlib
import random

import jsonschema
import pytest
import tiny_models
import torch
import xgrammar
from transformers import AutoTokenizer

from benchmarks.constrained import SCHEMA
from smollm2_draft.constrained_continuation import continue_under_constraints
from smollm2_draft.json_answers import json_request
from smollm2_draft.random_schemas import KEYS, random_object_schema
from specdec.sampling.constraints import ConstraintCompiler, ConstraintKind, ConstraintSpec

DEMO_TOKENIZER = pathlib.Path(__file__).resolve().parents[2] / "models" / "demo-target"
TOP_K = 8


@pytest.fixture(scope="module")
def setup():
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    teacher = tiny_models.tiny_llama(len(tokenizer), hidden=32, layers=2, seed=5)
    compiler = ConstraintCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    return tokenizer, teacher, compiler


def written(setup, prompts, constraints, greedy=True, new_tokens=48):
    tokenizer, teacher, compiler = setup
    return continue_under_constraints(
        teacher, compiler, prompts, constraints, greedy, tokenizer.eos_token_id, new_tokens, TOP_K
    )


def test_every_finished_row_is_json_its_schema_accepts_and_ends_with_the_end_of_text(setup):
    tokenizer = setup[0]
    rng = random.Random(0)
    constraints = [json_request("volcanoes", rng)[1] for _ in range(6)]
    prompts = [tokenizer(f"x = {i}\nCONFIG = ")["input_ids"] for i in range(6)]
    out = written(setup, prompts, constraints, new_tokens=96)
    finished = 0
    for row, spec in enumerate(constraints):
        length = int(out.valid[row].sum())
        ids = out.tokens[row, :length].tolist()
        if ids[-1] != tokenizer.eos_token_id:
            continue  # the budget ran out inside the value
        finished += 1
        value = json.loads(tokenizer.decode(ids[:-1]))
        assert isinstance(value, dict)
        if spec.kind is ConstraintKind.JSON_SCHEMA:
            jsonschema.validate(value, json.loads(spec.source))
        assert not out.valid[row, length:].any()
    assert finished >= 3


def masked_greedy_by_full_passes(setup, prompt: list[int], spec: ConstraintSpec, count: int) -> list[int]:
    """The reference: each token from a pass over the whole sequence, no cache."""
    tokenizer, teacher, compiler = setup
    matcher, bitmask = (
        xgrammar.GrammarMatcher(compiler.compile(spec)),
        xgrammar.allocate_token_bitmask(1, len(tokenizer)),
    )
    sequence = list(prompt)
    with torch.no_grad():
        for _ in range(count):
            logits = teacher(torch.tensor([sequence])).logits[:, -1].float()  # [1, V]
            matcher.fill_next_token_bitmask(bitmask, 0)
            xgrammar.apply_token_bitmask_inplace(logits, bitmask)
            sequence.append(int(logits.argmax()))
            matcher.accept_token(sequence[-1])
    return sequence[len(prompt) :]


def test_a_row_is_written_alike_alone_left_padded_in_a_batch_and_by_full_passes(setup):
    tokenizer = setup[0]
    spec = ConstraintSpec(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA))
    short = tokenizer("CONFIG = ")["input_ids"]
    long = tokenizer("def f(a, b):\n    return a + b\n\nCONFIG = ")["input_ids"]
    alone = written(setup, [short], [spec])
    batched = written(setup, [long, short], [spec, spec])
    length = int(alone.valid[0].sum())
    assert batched.tokens[1, :length].tolist() == alone.tokens[0, :length].tolist()
    assert alone.tokens[0, :12].tolist() == masked_greedy_by_full_passes(setup, short, spec, 12)
    torch.testing.assert_close(batched.top_logprobs[1, :length], alone.top_logprobs[0, :length], atol=2e-3, rtol=0)


def test_the_named_ids_are_the_allowed_ones_first_with_their_unmasked_log_probabilities(setup):
    tokenizer, teacher, compiler = setup
    spec = ConstraintSpec(ConstraintKind.REGEX, "(yes|no)")
    prompt = tokenizer("answer: ")["input_ids"]
    out = written(setup, [prompt], [spec], new_tokens=1)
    with torch.no_grad():
        unmasked = torch.log_softmax(teacher(torch.tensor([prompt])).logits[0, -1].float(), -1)  # [V]
    bitmask = xgrammar.allocate_token_bitmask(1, len(tokenizer))
    xgrammar.GrammarMatcher(compiler.compile(spec)).fill_next_token_bitmask(bitmask, 0)
    allowed = {i for i in range(len(tokenizer)) if bitmask[0, i // 32] >> (i % 32) & 1}
    assert 1 < len(allowed) < TOP_K
    named = out.top_ids[0, 0].tolist()
    assert set(named[: len(allowed)]) == allowed and out.tokens[0, 0].item() == named[0]
    assert named[: len(allowed)] == sorted(allowed, key=lambda i: -unmasked[i].item())
    torch.testing.assert_close(out.top_logprobs[0, 0].float(), unmasked[named], atol=1e-3, rtol=1e-3)


def test_random_schemas_leave_out_the_benchmarks_keys_and_chat_requests_name_every_field():
    benchmark_keys = {"name", "version", "tags", "options", "debug", "level"}
    assert not benchmark_keys & set(KEYS)
    rng = random.Random(1)
    for _ in range(20):
        schema = random_object_schema(rng)
        assert 2 <= len(schema["properties"]) <= 5 and set(schema["required"]) <= set(schema["properties"])
        message, spec = json_request("volcanoes", rng)
        assert message.startswith("Describe volcanoes as a JSON object")
        if spec.kind is ConstraintKind.JSON_SCHEMA:
            for key in json.loads(spec.source)["properties"]:
                assert key.replace("_", " ") in message
