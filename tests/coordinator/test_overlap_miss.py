"""Overlap's miss path: the pre-draft guessed "all accepted", the verdict says otherwise, and both caches end right.

The draft here disagrees with the target (a heavily perturbed copy), so most pre-drafts miss. Through the
stack, output must still be what the in-process references give; over the raw Drafter/Verifier RPCs, a
session that went through a missed pre-draft must behave exactly like a fresh session opened on the
committed sequence.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from tiny_models import make_pair

from specdec.client import Client
from specdec.decoding.reference_loop import speculative_generate, target_only_generate
from specdec.engine.model_runtime import LoadedModel, ModelSettings
from specdec.local_stack import LocalStack
from specdec.sampling.rules import SamplingParams, SamplingRule
from specdec.serving.wire import sampling_to_proto
from specdec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

VOCAB = 64
GAMMA = 3
MAX_NEW = 40


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("disagreeing_pair"), vocab_size=VOCAB, noise=1.0)


@pytest.fixture(scope="module")
def models(pair_dirs):
    target_dir, draft_dir = pair_dirs
    return LoadedModel.load(ModelSettings(str(target_dir))), LoadedModel.load(ModelSettings(str(draft_dir)))


@pytest.fixture(scope="module")
def stack(pair_dirs):
    target_dir, draft_dir = pair_dirs
    with LocalStack(str(target_dir), str(draft_dir), coordinator_args=["--overlap", "--no-adaptive-gamma"]) as running:
        yield running


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 8))] for _ in range(count)]


def test_missed_predrafts_leave_output_exact(stack, models):
    target, draft = models
    attempts = hits = 0
    with Client(stack.address, timeout_s=60) as client:
        for i, prompt in enumerate(prompts(4, seed=1)):
            greedy = client.generate(prompt, max_new_tokens=MAX_NEW, num_speculative_tokens=GAMMA, include_stats=True)
            assert list(greedy.token_ids) == target_only_generate(target, prompt, SamplingParams(), MAX_NEW).token_ids
            attempts += greedy.stats.predraft_attempts
            hits += greedy.stats.predraft_hits
            params = SamplingParams(temperature=1.0, seed=i, rule=SamplingRule.COUPLED)  # a seeded request's rule
            sampled = client.generate(
                prompt,
                max_new_tokens=MAX_NEW,
                temperature=1.0,
                seed=i,
                num_speculative_tokens=GAMMA,
                include_stats=True,
            )
            assert (
                list(sampled.token_ids) == speculative_generate(target, draft, prompt, GAMMA, params, MAX_NEW).token_ids
            )
            attempts += sampled.stats.predraft_attempts
            hits += sampled.stats.predraft_hits
        assert attempts > hits, "the disagreeing draft should make pre-drafts miss"
        # A follow-up request on the same replicas after all those misses is still exact.
        follow_up = [9, 9, 2, 31]
        reply = client.generate(follow_up, max_new_tokens=MAX_NEW, num_speculative_tokens=GAMMA)
        assert list(reply.token_ids) == target_only_generate(target, follow_up, SamplingParams(), MAX_NEW).token_ids


class Sessions:
    """A draft and a verify session opened over the raw RPCs, driven the way the coordinator drives them."""

    def __init__(self, drafter, verifier, session_id: str, prompt: list[int], params: SamplingParams):
        self.drafter, self.verifier, self.session_id = drafter, verifier, session_id
        sampling = sampling_to_proto(params)
        drafter.OpenSession(
            drafter_pb2.OpenDraftSessionRequest(session_id=session_id, prompt_token_ids=prompt, sampling=sampling),
            timeout=30,
        )
        verifier.OpenSession(
            verifier_pb2.OpenVerifySessionRequest(session_id=session_id, prompt_token_ids=prompt, sampling=sampling),
            timeout=30,
        )

    def propose_future(self, base_len: int, appended: list[int], num_tokens: int):
        return self.drafter.Propose.future(
            drafter_pb2.ProposeRequest(
                session_id=self.session_id,
                base_len=base_len,
                appended_token_ids=appended,
                num_speculative_tokens=num_tokens,
            ),
            timeout=30,
        )

    def propose(self, base_len: int, appended: list[int], num_tokens: int) -> drafter_pb2.ProposeResponse:
        return self.propose_future(base_len, appended, num_tokens).result()

    def verify_future(self, base_len: int, block: drafter_pb2.ProposeResponse):
        return self.verifier.Verify.future(
            verifier_pb2.VerifyRequest(
                session_id=self.session_id,
                base_len=base_len,
                draft_token_ids=block.draft_token_ids,
                draft_probs=block.draft_probs,
            ),
            timeout=30,
        )

    def close(self) -> None:
        request = common_pb2.CloseSessionRequest(session_id=self.session_id)
        self.drafter.CloseSession(request, timeout=30)
        self.verifier.CloseSession(request, timeout=30)


def q_rows(block: drafter_pb2.ProposeResponse) -> torch.Tensor:
    matrix = block.draft_probs
    return torch.frombuffer(bytearray(matrix.float32_data), dtype=torch.float32).reshape(matrix.rows, matrix.vocab_size)


def test_a_missed_predraft_rolls_both_caches_back(stack):
    """Round k is verified while block k+1 is pre-drafted under "all accepted"; the verdict rejects. The draft
    session then sits γ+1 tokens past the truth and the verify session holds rejected positions; the next
    calls' base_len must bring both back, which a fresh pair of sessions on the committed tokens shows."""
    params = SamplingParams(temperature=1.0, seed=7)  # sampled, so the draft returns q rows to compare
    with (
        grpc.insecure_channel(stack.services["draft"].address) as draft_channel,
        grpc.insecure_channel(stack.services["verify"].address) as verify_channel,
    ):
        drafter = drafter_pb2_grpc.DrafterStub(draft_channel)
        verifier = verifier_pb2_grpc.VerifierStub(verify_channel)
        missed = 0
        for attempt, prompt in enumerate(prompts(6, seed=5)):
            sessions = Sessions(drafter, verifier, f"miss-{attempt}", prompt, params)
            committed = list(prompt)
            block = sessions.propose(len(committed), [], GAMMA)
            # Overlap: Verify(block k) and the pre-draft of block k+1 run at the same time.
            verdict_future = sessions.verify_future(len(committed), block)
            predraft = sessions.propose(len(committed) + GAMMA, [], GAMMA + 1)
            verdict = verdict_future.result()
            assert len(predraft.draft_token_ids) == GAMMA + 1 and predraft.session_len == len(committed) + 2 * GAMMA + 1
            if len(verdict.accepted_token_ids) == GAMMA:
                sessions.close()
                continue  # the guess may have been right; this test wants a miss
            missed += 1
            accepted = len(verdict.accepted_token_ids)
            synced = len(committed) + accepted
            committed += [*verdict.accepted_token_ids, verdict.next_token_id]
            assert verdict.session_len == len(committed)

            fresh = Sessions(drafter, verifier, f"fresh-{attempt}", committed, params)
            old_block = sessions.propose(synced, committed[synced:], GAMMA)  # rolls the draft back via base_len
            for _ in range(3):
                fresh_block = fresh.propose(len(committed), [], GAMMA)
                assert list(old_block.draft_token_ids) == list(fresh_block.draft_token_ids)
                assert old_block.session_len == fresh_block.session_len == len(committed) + GAMMA
                torch.testing.assert_close(q_rows(old_block), q_rows(fresh_block), rtol=1e-4, atol=1e-6)
                with ThreadPoolExecutor(2) as pool:  # the verify side, old and fresh, on the same block
                    old_verdict, fresh_verdict = pool.map(
                        lambda s: s.verify_future(len(committed), old_block).result(), (sessions, fresh)
                    )
                assert list(old_verdict.accepted_token_ids) == list(fresh_verdict.accepted_token_ids)
                assert old_verdict.next_token_id == fresh_verdict.next_token_id
                assert old_verdict.session_len == fresh_verdict.session_len
                synced = len(committed) + len(old_verdict.accepted_token_ids)
                committed += [*old_verdict.accepted_token_ids, old_verdict.next_token_id]
                old_block = sessions.propose(synced, committed[synced:], GAMMA)
                fresh.propose(synced, committed[synced:], 0)  # keep the fresh draft session in step
            sessions.close()
            fresh.close()
        assert missed >= 2
