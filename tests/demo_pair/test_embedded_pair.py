"""The committed demo pair: it loads, its two tokenizers match, and greedy speculation reproduces the target."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from load_tests.prompts import code_prompts
from specdec.client import Client
from specdec.decoding.reference_loop import speculative_generate, target_only_generate
from specdec.engine.embedded_pair import DEMO_DRAFT_DIR, DEMO_TARGET_DIR
from specdec.engine.model_runtime import LoadedModel, ModelSettings, check_same_vocabulary
from specdec.local_stack import LocalStack
from specdec.sampling.rules import SamplingParams

MAX_NEW = 32

pytestmark = pytest.mark.skipif(
    not (DEMO_TARGET_DIR / "config.json").exists(),
    reason=f"the demo pair is not in this checkout ({DEMO_TARGET_DIR} is absent); "
    "train it with `python -m demo_pair.train all`",
)


@pytest.fixture(scope="module")
def pair() -> tuple[LoadedModel, LoadedModel]:
    return LoadedModel.load(ModelSettings(str(DEMO_TARGET_DIR))), LoadedModel.load(ModelSettings(str(DEMO_DRAFT_DIR)))


def test_tokenizers_match(pair):
    target, draft = pair
    check_same_vocabulary(target.identity, draft.identity)
    text = "def main(argv=None):\n    return {'α': [1, 2.5]}\n"
    assert target.tokenizer(text)["input_ids"] == draft.tokenizer(text)["input_ids"]
    assert target.eos_token_ids == draft.eos_token_ids


def test_greedy_speculation_equals_target_only_on_held_out_prompts(pair):
    target, draft = pair
    accepted = 0
    for prompt in code_prompts(5, seed=4):
        prompt_ids = target.tokenizer(prompt.prompt, add_special_tokens=False)["input_ids"]
        expected = target_only_generate(target, prompt_ids, SamplingParams(), MAX_NEW)
        got = speculative_generate(target, draft, prompt_ids, 4, SamplingParams(), MAX_NEW)
        assert got.token_ids == expected.token_ids, f"prompt from {prompt.source}"
        accepted += got.stats.accepted
    assert accepted > 0  # the draft is a real draft of this target, not noise


def test_concurrent_greedy_requests_through_the_batching_stack_equal_target_only(pair):
    """The stack as deployed (batching, adaptive γ, overlap with guessed verdicts and next-call hints) on a pair
    where speculation pays: 8 concurrent prompts of different lengths, each token-identical to the target alone."""
    target, _ = pair
    prompts = [target.tokenizer(p.prompt, add_special_tokens=False)["input_ids"] for p in code_prompts(8, seed=11)]
    assert len({len(ids) for ids in prompts}) > 1
    expected = [target_only_generate(target, ids, SamplingParams(), MAX_NEW).token_ids for ids in prompts]
    with (
        LocalStack(str(DEMO_TARGET_DIR), str(DEMO_DRAFT_DIR)) as stack,
        Client(stack.address, timeout_s=120) as client,
        ThreadPoolExecutor(len(prompts)) as pool,
    ):
        replies = list(pool.map(lambda ids: client.generate(ids, max_new_tokens=MAX_NEW, include_stats=True), prompts))
    assert [list(reply.token_ids) for reply in replies] == expected
    assert sum(reply.stats.accepted_tokens for reply in replies) > 0  # the policy speculated
