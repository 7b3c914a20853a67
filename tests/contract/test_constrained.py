"""Constrained and penalised requests through the public API: speculation changes the speed only.

Held to: 100 requests under five JSON schemas (nested objects, enums, arrays, bounded integers and numbers), greedy,
seeded and unseeded, 16 at a time over both coordinators, all end with EOS and their text parses and validates;
greedy constrained and penalised output equals plain constrained decoding written out here (the target with
transformers, its logits masked by xgrammar and penalised as vLLM does), with adaptive γ on and off, the model and
the n-gram drafter, unary and streamed; a seeded constrained request equals the same request at γ 0; under tensor
parallelism 2 with overlap on and off the same holds; an invalid constraint or an out-of-range penalty is
INVALID_ARGUMENT naming its field.
"""

from __future__ import annotations

import concurrent.futures
import json
import math

import grpc
import jsonschema
import pytest
import torch
import xgrammar
from harness import TARGET_DIR, in_parallel, joined, request

from specdec.v1 import common_pb2, coordinator_pb2

MODEL, NGRAM = common_pb2.DRAFT_METHOD_MODEL, common_pb2.DRAFT_METHOD_NGRAM
EOS_FINISH = coordinator_pb2.FINISH_REASON_EOS
LENGTH_FINISH = coordinator_pb2.FINISH_REASON_LENGTH
SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "owner": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999}, "admin": {"type": "boolean"}},
                "required": ["id", "admin"],
            },
        },
        "required": ["name", "owner"],
    },
    {
        "type": "object",
        "properties": {"level": {"enum": ["debug", "info", "error"]}, "code": {"type": "integer", "maximum": 599}},
        "required": ["level", "code"],
    },
    {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 4},
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "array",
                "items": {"type": "number", "minimum": -100, "maximum": 100},
                "minItems": 2,
                "maxItems": 2,
            },
            "unit": {"enum": ["m", "km"]},
        },
        "required": ["point", "unit"],
    },
    {
        "type": "object",
        "properties": {
            "rows": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"k": {"type": "string", "maxLength": 6}, "v": {"type": "integer", "maximum": 99}},
                    "required": ["k", "v"],
                },
                "maxItems": 2,
            }
        },
        "required": ["rows"],
    },
]
PROMPTS = ["config = ", "def load(path):\n    return ", "# settings\n", "x = {", "print("]
REGEX = r"[a-z_]{1,12}\([0-9]{1,3}(, [0-9]{1,3}){0,3}\)"
MAX_NEW = 160


def schema_constraint(schema: dict) -> common_pb2.Constraint:
    return common_pb2.Constraint(json_schema=json.dumps(schema))


def with_penalties(message: coordinator_pb2.GenerateRequest, **penalties) -> coordinator_pb2.GenerateRequest:
    for name, value in penalties.items():
        setattr(message.sampling, name, value)
    return message


@pytest.fixture(scope="module")
def grammar_compiler(target) -> xgrammar.GrammarCompiler:
    model, tokenizer = target
    info = xgrammar.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=model.config.vocab_size, stop_token_ids=[tokenizer.eos_token_id]
    )
    return xgrammar.GrammarCompiler(info)


@torch.no_grad()
def plain_constrained_greedy(target, compiled, prompt: list[int], max_new: int, **penalties) -> list[int]:
    """Greedy decoding with the target alone: logits penalised over prompt and output, masked by a fresh matcher."""
    model, tokenizer = target
    matcher = xgrammar.GrammarMatcher(compiled)
    mask = xgrammar.allocate_token_bitmask(1, model.config.vocab_size)
    sequence, output = list(prompt), []
    for _ in range(max_new):
        logits = model(torch.tensor([sequence])).logits[0, -1:].float()  # [1, V]
        r = penalties.get("repetition_penalty", 1.0)
        for token in set(sequence):
            logits[0, token] = logits[0, token] / r if logits[0, token] > 0 else logits[0, token] * r
        for token in set(output):
            logits[0, token] -= penalties.get("frequency_penalty", 0.0) * output.count(token)
            logits[0, token] -= penalties.get("presence_penalty", 0.0)
        matcher.fill_next_token_bitmask(mask)
        xgrammar.apply_token_bitmask_inplace(logits, mask)
        assert logits.max() > -math.inf, "a dead end: choose another prompt"
        token = int(logits[0].argmax())
        output.append(token)
        sequence.append(token)
        if token == tokenizer.eos_token_id:
            break
        assert matcher.accept_token(token)
    return output


def finished_json(reply, tokenizer) -> object:
    assert reply.finish_reason == EOS_FINISH, f"finish {reply.finish_reason}: {reply.text!r}"
    return json.loads(tokenizer.decode(list(reply.token_ids), skip_special_tokens=True))


def compiled_schema(grammar_compiler, schema: dict) -> xgrammar.CompiledGrammar:
    """The schema compiled as the server compiles it: a length-bounded string refuses control characters, as JSON
    does."""
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
    return grammar_compiler.compile_grammar(str(grammar).replace(r"[^\"\\\r\n]", r"[^\0-\x1f\"\\\r\n]"))


def test_schema_requests_parse_and_validate(shared_stack, target, grammar_compiler):
    """Every finished output parses and validates; a sampled one that drew, say, an endless number and ran out of
    tokens is a prefix the schema's grammar accepts. Most of them finish."""
    tokenizer = target[1]
    cases = []
    for index in range(100):
        schema, prompt = SCHEMAS[index % len(SCHEMAS)], PROMPTS[(index // len(SCHEMAS)) % len(PROMPTS)]
        sampling = [dict(), dict(temperature=0.7, seed=index), dict(temperature=0.8, top_p=0.9)][index % 3]
        coordinator = shared_stack.adaptive if index % 2 else shared_stack.fixed
        message = request(prompt, MAX_NEW, constraint=schema_constraint(schema), **sampling)
        cases.append((coordinator, message, schema))

    def run(case):
        coordinator, message, schema = case
        return coordinator.generate(message, timeout_s=300), schema

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(run, cases))
    finished = [(reply, schema) for reply, schema in replies if reply.finish_reason == EOS_FINISH]
    for reply, schema in finished:
        jsonschema.validate(finished_json(reply, tokenizer), schema)
    for reply, schema in replies:
        if reply.finish_reason != EOS_FINISH:
            assert reply.finish_reason == LENGTH_FINISH, reply
            matcher = xgrammar.GrammarMatcher(compiled_schema(grammar_compiler, schema))
            assert all(matcher.accept_token(token) for token in reply.token_ids), reply.text
    assert len(finished) >= 90, [reply.text for reply, _ in replies if reply.finish_reason != EOS_FINISH]


GREEDY_CASES = [
    ("fixed", MODEL, "schema0"),
    ("adaptive", MODEL, "schema3"),
    ("fixed", NGRAM, "schema4"),
    ("adaptive", MODEL, "regex"),
    ("fixed", MODEL, "penalties"),
    ("adaptive", NGRAM, "penalties"),
]


def greedy_case(kind: str, grammar_compiler):
    """(constraint message, compiled grammar, penalties) of a greedy case."""
    if kind == "regex":
        return common_pb2.Constraint(regex=REGEX), grammar_compiler.compile_regex(REGEX), {}
    schema = SCHEMAS[int(kind[-1])] if kind.startswith("schema") else SCHEMAS[1]
    compiled = compiled_schema(grammar_compiler, schema)
    penalties = dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3) if kind == "penalties" else {}
    return schema_constraint(schema), compiled, penalties


@pytest.mark.parametrize("coordinator, method, kind", GREEDY_CASES, ids=[f"{c}-{m}-{k}" for c, m, k in GREEDY_CASES])
def test_greedy_constrained_equals_plain_constrained(shared_stack, target, grammar_compiler, coordinator, method, kind):
    tokenizer = target[1]
    constraint, compiled, penalties = greedy_case(kind, grammar_compiler)
    prompt = tokenizer(PROMPTS[0], add_special_tokens=False)["input_ids"]
    expected = plain_constrained_greedy(target, compiled, prompt, MAX_NEW, **penalties)
    message = with_penalties(request(prompt, MAX_NEW, constraint=constraint, draft_method=method), **penalties)
    client = getattr(shared_stack, coordinator)
    reply = client.generate(message)
    assert list(reply.token_ids) == expected
    assert joined(client.stream_all(message))[0] == expected


def test_seeded_constrained_equals_seeded_plain(shared_stack, target):
    tokenizer = target[1]
    for seed, schema in enumerate(SCHEMAS[:3]):

        def seeded(gamma: int, method: int = MODEL) -> coordinator_pb2.GenerateRequest:
            message = request(
                PROMPTS[1],
                MAX_NEW,
                temperature=0.9,
                top_k=50,
                seed=seed,
                num_speculative_tokens=gamma,
                constraint=schema_constraint(schema),
                draft_method=method,
            )
            return with_penalties(message, frequency_penalty=0.3, min_p=0.02)

        plain = shared_stack.fixed.generate(seeded(0))
        jsonschema.validate(finished_json(plain, tokenizer), schema)
        for client, gamma, method in ((shared_stack.fixed, 4, MODEL), (shared_stack.adaptive, 3, NGRAM)):
            assert list(client.generate(seeded(gamma, method)).token_ids) == list(plain.token_ids)
        assert joined(shared_stack.adaptive.stream_all(seeded(4)))[0] == list(plain.token_ids)


@pytest.fixture(scope="module")
def tensor_parallel_coordinators(shared_stack):
    """Coordinators with overlap on and off, on the shared drafter and a verifier sharded over 2 ranks."""
    verify = shared_stack.group.serve(
        "verify", "--model", str(TARGET_DIR), "--tensor-parallel-size", "2", name="verify-tp2-constrained"
    )
    overlapped, sequential = in_parallel(
        lambda: shared_stack.start_coordinator(verify=verify.address, name="coordinator-tp2-overlap"),
        lambda: shared_stack.start_coordinator("--no-overlap", verify=verify.address, name="coordinator-tp2-seq"),
    )
    yield overlapped, sequential
    for coordinator in (overlapped, sequential):
        coordinator.close()
    verify.stop()


def test_tensor_parallel_with_overlap_on_and_off(tensor_parallel_coordinators, shared_stack, target, grammar_compiler):
    tokenizer = target[1]
    constraint, compiled, _ = greedy_case("schema0", grammar_compiler)
    prompt = tokenizer(PROMPTS[2], add_special_tokens=False)["input_ids"]
    expected = plain_constrained_greedy(target, compiled, prompt, MAX_NEW)

    def seeded(gamma: int) -> coordinator_pb2.GenerateRequest:
        return request(
            PROMPTS[3], MAX_NEW, temperature=0.8, seed=7, constraint=constraint, num_speculative_tokens=gamma
        )

    seeded_plain = list(shared_stack.fixed.generate(seeded(0)).token_ids)
    for client in tensor_parallel_coordinators:
        assert list(client.generate(request(prompt, MAX_NEW, constraint=constraint)).token_ids) == expected
        assert list(client.generate(seeded(4)).token_ids) == seeded_plain
        assert joined(client.stream_all(seeded(4)))[0] == seeded_plain


BAD_REQUESTS = [
    (dict(constraint=common_pb2.Constraint(json_schema='{"type": "strin"}')), "constraint.json_schema", "strin"),
    (dict(constraint=common_pb2.Constraint(json_schema="{")), "constraint.json_schema", "line 1"),
    (dict(constraint=common_pb2.Constraint(regex="a(b")), "constraint.regex", "parenthesis"),
    (dict(constraint=common_pb2.Constraint(grammar="root ::= foo")), "constraint.grammar", "foo"),
    (dict(constraint=common_pb2.Constraint(regex="a" * 70_000)), "constraint.regex", "limit"),
    (dict(repetition_penalty=0.0), "sampling.repetition_penalty", "(0, 10.0]"),
    (dict(frequency_penalty=2.5), "sampling.frequency_penalty", "[-2.0, 2.0]"),
    (dict(presence_penalty=-3.0), "sampling.presence_penalty", "[-2.0, 2.0]"),
    (dict(min_p=1.5), "sampling.min_p", "[0, 1]"),
]


@pytest.mark.parametrize(
    "fields, field, reason", BAD_REQUESTS, ids=[b[1] + "-" + str(i) for i, b in enumerate(BAD_REQUESTS)]
)
def test_bad_constraints_and_penalties_are_named(shared_stack, fields, field, reason):
    constraint = fields.pop("constraint", None)
    message = request(PROMPTS[0], 8, **({"constraint": constraint} if constraint is not None else {}))
    with_penalties(message, **fields)
    with pytest.raises(grpc.RpcError) as raised:
        shared_stack.fixed.generate(message)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in raised.value.details() and reason in raised.value.details(), raised.value.details()
