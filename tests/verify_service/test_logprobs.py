"""The verifier's log-probabilities: the target's own, the same through speculation and plain decoding, and equal
to transformers' log-softmax of the target's logits (docs/architecture.md, "Log-probabilities")."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec.sampling.rules import SamplingParams, SamplingRule
from verify_service.service import VerifyService
from verify_service.settings import VerifySettings

GREEDY = SamplingParams()
PROMPT = [4, 8, 15, 16, 23, 42]
NEW_TOKENS = 12
TOP = 3


@pytest.fixture(scope="module")
def service(tiny_pair):
    return VerifyService(VerifySettings(), tiny_pair[0])


def plain_decode(service: VerifyService, session_id: str, params: SamplingParams = GREEDY):
    """NEW_TOKENS plain steps (the first from the prefill's last row): the tokens and their logprobs."""
    service.open(session_id, PROMPT, params, top_logprobs=TOP)
    tokens, logprobs = [], []
    for _ in range(NEW_TOKENS):
        verdict, _, _ = service.verify(session_id, len(PROMPT) + len(tokens), [], None)
        tokens += verdict.tokens
        logprobs += verdict.logprobs
    service.close(session_id)
    return tokens, logprobs


def speculative_decode(service: VerifyService, greedy_tokens: list[int]):
    """The same greedy tokens through blocks of 3 drafted tokens: all accepted (with a bonus) and, every other
    round, a wrong last token (a rejection and a recovered token)."""
    service.open("spec", PROMPT, GREEDY, top_logprobs=TOP)
    tokens, logprobs, kinds = [], [], set()
    while len(tokens) < NEW_TOKENS:
        draft = list(greedy_tokens[len(tokens) : len(tokens) + 3])
        if len(kinds) % 2 and len(draft) == 3:
            draft[-1] = (draft[-1] + 1) % 64
        verdict, _, _ = service.verify("spec", len(PROMPT) + len(tokens), draft, None)
        kinds.add("bonus" if verdict.is_bonus else "recovered")
        tokens += verdict.tokens
        logprobs += verdict.logprobs
        assert len(verdict.logprobs) == len(verdict.tokens)
    service.close("spec")
    assert kinds == {"bonus", "recovered"}
    return tokens[:NEW_TOKENS], logprobs[:NEW_TOKENS]


def reference_logprobs(target_dir, tokens: list[int]) -> torch.Tensor:
    """transformers' log-softmax of the target's logits at each generated position: [n, V]."""
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + tokens])).logits[0]  # [P + n, V]
    return torch.log_softmax(logits[len(PROMPT) - 1 : -1].float(), dim=-1)


def test_logprobs_agree_through_speculation_plain_decoding_and_transformers(service, tiny_pair_dirs):
    plain_tokens, plain = plain_decode(service, "plain")
    spec_tokens, spec = speculative_decode(service, plain_tokens)
    assert spec_tokens == plain_tokens
    reference = reference_logprobs(tiny_pair_dirs[0], plain_tokens)
    for position, (a, b) in enumerate(zip(plain, spec)):
        assert a.token == b.token == plain_tokens[position]
        assert abs(a.logprob - b.logprob) <= 1e-5
        assert abs(a.logprob - reference[position, a.token].item()) <= 1e-5
        assert a.top_tokens == b.top_tokens == tuple(reference[position].topk(TOP).indices.tolist())
        torch.testing.assert_close(
            torch.tensor(a.top_logprobs), reference[position].topk(TOP).values, atol=1e-5, rtol=0
        )
        assert a.top_tokens[0] == a.token  # greedy: the token is the most likely one


def test_sampled_logprobs_describe_the_target_before_temperature(service, tiny_pair_dirs):
    params = SamplingParams(temperature=1.7, top_k=5, top_p=0.9, seed=3, rule=SamplingRule.COUPLED)
    tokens, logprobs = plain_decode(service, "sampled", params)
    reference = reference_logprobs(tiny_pair_dirs[0], tokens)
    for position, logprob in enumerate(logprobs):
        assert abs(logprob.logprob - reference[position, logprob.token].item()) <= 1e-5


def test_sessions_that_do_not_ask_get_none(service):
    service.open("quiet", PROMPT, GREEDY)
    verdict, _, _ = service.verify("quiet", len(PROMPT), [], None)
    service.close("quiet")
    assert verdict.logprobs == ()


def test_top_zero_gives_the_token_alone(service):
    service.open("bare", PROMPT, GREEDY, top_logprobs=0)
    verdict, _, _ = service.verify("bare", len(PROMPT), [], None)
    service.close("bare")
    [logprob] = verdict.logprobs
    assert logprob.top_tokens == () and logprob.logprob <= 0
