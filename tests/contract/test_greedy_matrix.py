"""Greedy decoding through the public API is the target alone, token for token.

Held to: for max_new_tokens 1, γ and γ + 1 (γ 4 and the largest γ the coordinator allows), with adaptive γ
on and off and with the model and n-gram drafters, and for a prompt plus completion exactly at the context
limit, the tokens equal an argmax loop over the target run with transformers; GenerateStream's chunks
concatenated equal Generate's reply (tokens and text), and only the last chunk carries the finish reason;
the finish reason is LENGTH at the budget, STOP at a stop string (whose text is cut before the stop string)
and EOS at the end-of-sequence token, which ends the completion. One token past the context limit is
INVALID_ARGUMENT.
"""

from __future__ import annotations

import concurrent.futures

import grpc
import pytest
from harness import joined, request
from reference import greedy

from specdec.v1 import common_pb2, coordinator_pb2

LENGTH = coordinator_pb2.FINISH_REASON_LENGTH
STOP = coordinator_pb2.FINISH_REASON_STOP
EOS = coordinator_pb2.FINISH_REASON_EOS
UNSPECIFIED = coordinator_pb2.FINISH_REASON_UNSPECIFIED
MODEL, NGRAM = common_pb2.DRAFT_METHOD_MODEL, common_pb2.DRAFT_METHOD_NGRAM
PROMPT_TEXT = "def fibonacci(n):\n    "
STOP_PROMPT_TEXT = "class Stack:\n    def __init__(self):\n        "
# The end of weakref.py in the target's training data: the target's EOS probability is ~5% right after it.
EOS_PROMPT_TEXT = (
    " during shutdown\n            finalize._shutdown = True\n"
    "            if reenable_gc:\n                gc.enable()\n"
)
EOS_SEEDS = range(200)


@pytest.fixture(scope="module")
def info(shared_stack) -> coordinator_pb2.CoordinatorInfo:
    return shared_stack.fixed.info()


@pytest.fixture(scope="module")
def tokenizer(target):
    return target[1]


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    return tokenizer(PROMPT_TEXT)["input_ids"]


@pytest.fixture(scope="module")
def expected(target, prompt, info) -> list[int]:
    """Target-only greedy continuation of PROMPT, as long as the longest case needs."""
    return greedy(target[0], prompt, info.max_num_speculative_tokens + 1, target[1].eos_token_id)


def unary_and_stream(coordinator, message):
    """Generate's reply and GenerateStream's chunks for one request, both checked for their shape."""
    reply = coordinator.generate(message)
    chunks = coordinator.stream_all(message)
    assert chunks and all(c.finish_reason == UNSPECIFIED for c in chunks[:-1]), "finish reason before the end"
    assert joined(chunks) == (list(reply.token_ids), reply.text), "stream differs from the unary reply"
    assert chunks[-1].finish_reason == reply.finish_reason
    return reply, chunks


def gamma_of(name: str, info) -> int:
    return info.max_num_speculative_tokens if name == "max" else int(name)


CASES = [
    (coordinator, gamma, budget, MODEL)
    for coordinator in ("adaptive", "fixed")
    for gamma in ("4", "max")
    for budget in ("1", "gamma", "gamma+1")
] + [("fixed", "4", budget, NGRAM) for budget in ("1", "gamma", "gamma+1")]


@pytest.mark.parametrize(
    "coordinator,gamma,budget,method",
    CASES,
    ids=[f"{c}-gamma{g}-new{b}-{'ngram' if m == NGRAM else 'model'}" for c, g, b, m in CASES],
)
def test_greedy_equals_the_target_alone(
    shared_stack, info, tokenizer, prompt, expected, coordinator, gamma, budget, method
):
    num_speculative = gamma_of(gamma, info)
    max_new = {"1": 1, "gamma": num_speculative, "gamma+1": num_speculative + 1}[budget]
    message = request(prompt, max_new, num_speculative_tokens=num_speculative, draft_method=method)
    reply, _ = unary_and_stream(getattr(shared_stack, coordinator), message)
    assert tokenizer.eos_token_id not in expected[:max_new]  # the prompt is chosen so that LENGTH ends it
    assert list(reply.token_ids) == expected[:max_new]
    assert reply.text == tokenizer.decode(expected[:max_new], skip_special_tokens=True)
    assert reply.finish_reason == LENGTH


@pytest.mark.parametrize("coordinator,gamma", [("fixed", "4"), ("adaptive", "max")])
def test_prompt_plus_completion_at_the_context_limit(shared_stack, info, target, tokenizer, coordinator, gamma):
    num_speculative = gamma_of(gamma, info)
    max_new = num_speculative + 1
    text = "".join(f"    value_{i} = compute(value_{i - 1}, {i % 7})\n" for i in range(1, 400))
    prompt = tokenizer(text)["input_ids"][: info.max_context_tokens - max_new]
    assert len(prompt) + max_new == info.max_context_tokens
    stub = getattr(shared_stack, coordinator)
    reply, _ = unary_and_stream(stub, request(prompt, max_new, num_speculative_tokens=num_speculative))
    reference = greedy(target[0], prompt, max_new, tokenizer.eos_token_id)
    assert list(reply.token_ids) == reference
    assert reply.finish_reason == (EOS if reference[-1] == tokenizer.eos_token_id else LENGTH)
    with pytest.raises(grpc.RpcError) as past_limit:
        stub.generate(request(prompt, max_new + 1, num_speculative_tokens=num_speculative))
    assert past_limit.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("coordinator", ["adaptive", "fixed"])
def test_stop_strings(shared_stack, target, tokenizer, coordinator):
    prompt = tokenizer(STOP_PROMPT_TEXT)["input_ids"]
    reference = greedy(target[0], prompt, 32, tokenizer.eos_token_id)
    full_text = tokenizer.decode(reference, skip_special_tokens=True)
    # A stop string the target's text reaches around its 10th token, which does not occur before.
    start = len(tokenizer.decode(reference[:9], skip_special_tokens=True))
    stop = next(
        full_text[i : i + 3] for i in range(start, len(full_text) - 3) if full_text[i : i + 3] not in full_text[: i + 2]
    )
    stops = ["\x00never\x00", stop]
    cut = next(
        k for k in range(1, len(reference) + 1) if stop in tokenizer.decode(reference[:k], skip_special_tokens=True)
    )
    assert cut < len(reference), "the stop string must end the completion before its budget"
    message = request(prompt, len(reference), stop=stops, num_speculative_tokens=4)
    reply, _ = unary_and_stream(getattr(shared_stack, coordinator), message)
    assert reply.finish_reason == STOP
    assert list(reply.token_ids) == reference[:cut]  # up to the token that completed the stop string
    text = tokenizer.decode(reference[:cut], skip_special_tokens=True)
    assert reply.text == text[: text.index(stop)]  # the stop string itself is not returned


def test_eos_ends_the_completion(shared_stack, tokenizer):
    """The target never ranks EOS first for these models, so EOS is reached by sampling (p ~ 5% per seed at
    the first position): every reply that holds EOS must end with it and say EOS, every other one is LENGTH."""
    prompt = tokenizer(EOS_PROMPT_TEXT)["input_ids"]
    eos = tokenizer.eos_token_id
    max_new = 3

    def run(seed):
        return shared_stack.fixed.generate(
            request(prompt, max_new, temperature=1.0, seed=seed, num_speculative_tokens=4)
        )

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(run, EOS_SEEDS))
    ended = [r for r in replies if eos in r.token_ids]
    assert ended, f"no seed of {len(EOS_SEEDS)} reached EOS: the test proves nothing"
    for reply in replies:
        tokens = list(reply.token_ids)
        if eos in tokens:
            assert tokens.index(eos) == len(tokens) - 1 and reply.finish_reason == EOS, tokens
        else:
            assert len(tokens) == max_new and reply.finish_reason == LENGTH, tokens
        assert reply.text == tokenizer.decode(tokens, skip_special_tokens=True)
    seed = EOS_SEEDS[replies.index(ended[0])]
    reply, chunks = unary_and_stream(  # the same request again, unary and streamed: the same completion
        shared_stack.fixed, request(prompt, max_new, temperature=1.0, seed=seed, num_speculative_tokens=4)
    )
    assert list(reply.token_ids) == list(ended[0].token_ids) and chunks[-1].finish_reason == EOS
