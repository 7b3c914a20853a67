"""The three real servers on loopback: exactness, concurrency, streaming, errors, cancellation, overlap."""

from __future__ import annotations

import concurrent.futures
import random
import time

import grpc
import pytest
from seeded_reference import assert_seeded_requests_equal_the_reference

from coordinator.draft_lanes import DraftLane
from coordinator.verdict_guesses import guesses
from specdec.client import Client
from specdec.decoding.reference_loop import target_only_generate
from specdec.engine.model_runtime import LoadedModel, ModelSettings
from specdec.local_stack import LocalStack
from specdec.sampling.rules import SamplingParams, SamplingRule
from specdec.serving.wire import sampling_to_proto
from specdec.v1 import common_pb2, coordinator_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

MAX_NEW = 24
LANES_GAMMA = 3
MAX_GAMMA = 16  # the coordinator's and the services' default limit
COUPLED, REJECTION = common_pb2.SAMPLING_RULE_COUPLED, common_pb2.SAMPLING_RULE_REJECTION


@pytest.fixture(scope="module")
def stack(tiny_pair_dirs):
    """Fixed γ (adaptive γ changes which draws a sampled request uses, not their distribution: see
    test_batching.py), so sampled outputs can be compared draw for draw with the reference loop."""
    target_dir, draft_dir = tiny_pair_dirs
    with LocalStack(
        str(target_dir), str(draft_dir), coordinator_args=["--max-new-tokens-limit", "200", "--no-adaptive-gamma"]
    ) as running:
        yield running


@pytest.fixture(scope="module")
def sequential_address(stack):
    """A second coordinator on the same replicas with overlap off."""
    service = stack.start_coordinator("coordinator-sequential", "--no-overlap", "--no-adaptive-gamma")
    yield service.address
    service.stop()


@pytest.fixture(scope="module")
def adaptive_address(stack):
    """A third coordinator on the same replicas with adaptive γ and the gate on (their defaults)."""
    service = stack.start_coordinator("coordinator-adaptive")
    yield service.address
    service.stop()


@pytest.fixture(scope="module")
def models(tiny_pair_dirs):
    target_dir, draft_dir = tiny_pair_dirs
    return LoadedModel.load(ModelSettings(str(target_dir))), LoadedModel.load(ModelSettings(str(draft_dir)))


@pytest.fixture(scope="module")
def client(stack):
    with Client(stack.address, timeout_s=60) as c:
        yield c


def random_prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 64) for _ in range(rng.randint(2, 10))] for _ in range(count)]


def test_greedy_output_is_token_identical_to_target_only(client, models):
    target, _ = models
    chained_rounds = 0
    for gamma in (1, 4):
        for prompt in random_prompts(6, seed=gamma):
            expected = target_only_generate(target, prompt, SamplingParams(), MAX_NEW).token_ids
            reply = client.generate(prompt, max_new_tokens=MAX_NEW, num_speculative_tokens=gamma, include_stats=True)
            assert list(reply.token_ids) == expected
            assert reply.stats.rounds >= 1 and reply.stats.drafted_tokens >= reply.stats.accepted_tokens
            chained_rounds += reply.stats.chained_rounds
    assert chained_rounds > 0  # overlapped rounds went to the verifier ahead of their verdicts (VerifyNext)


def test_the_largest_gamma_works_and_stays_identical_to_target_only(client, models):
    """At the coordinator's largest γ (16, the drafter's --max-speculative-tokens too) the "all accepted"
    pre-draft lane drafts γ + 1 tokens (its bonus-token guess first): the drafter takes them."""
    target, _ = models
    for prompt in random_prompts(2, seed=16):
        expected = target_only_generate(target, prompt, SamplingParams(), 80).token_ids
        reply = client.generate(prompt, max_new_tokens=80, num_speculative_tokens=16, include_stats=True)
        assert list(reply.token_ids) == expected
        assert reply.stats.predraft_attempts > 0 or reply.stats.rounds == 1


def test_plain_decoding_through_the_verifier(client, models):
    target, _ = models
    prompt = [7, 3, 9]
    reply = client.generate(prompt, max_new_tokens=MAX_NEW, num_speculative_tokens=0, include_stats=True)
    assert list(reply.token_ids) == target_only_generate(target, prompt, SamplingParams(), MAX_NEW).token_ids
    assert reply.stats.drafted_tokens == 0 and reply.stats.rounds == len(reply.token_ids)
    assert reply.stats.chained_rounds == reply.stats.rounds - 1  # each next step handed over ahead of its verdict


def test_eight_concurrent_requests_each_match_their_reference(client, models):
    target, _ = models
    prompts = random_prompts(8, seed=11)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda p: client.generate(p, max_new_tokens=MAX_NEW), prompts))
    for prompt, reply in zip(prompts, replies):
        assert list(reply.token_ids) == target_only_generate(target, prompt, SamplingParams(), MAX_NEW).token_ids


def test_stream_chunks_concatenate_to_the_unary_result(client):
    prompt = "w5 w9 w13"
    unary = client.generate(prompt, max_new_tokens=MAX_NEW, temperature=0.8, seed=3)
    chunks = list(client.stream(prompt, max_new_tokens=MAX_NEW, temperature=0.8, seed=3))
    assert "".join(c.text for c in chunks) == unary.text
    assert [t for c in chunks for t in c.token_ids] == list(unary.token_ids)
    assert chunks[-1].finish_reason == unary.finish_reason != 0
    assert all(c.finish_reason == 0 for c in chunks[:-1])


def test_stop_strings_end_generation(client):
    prompt, full = next(
        (p, r)
        for p in ("w5 w9 w13", "w7 w8", "w30 w2 w2", "w11", "w40 w41")
        if len((r := client.generate(p, max_new_tokens=MAX_NEW)).text.split()) > 3
    )
    stop = " " + full.text.split()[2]
    cut = client.generate(prompt, max_new_tokens=MAX_NEW, stop=[stop])
    assert cut.finish_reason == 2 and stop not in cut.text and full.text.startswith(cut.text)


def test_sampled_output_equals_the_in_process_reference_with_and_without_overlap(client, sequential_address, models):
    """Draws are keyed by (seed, position): the stack, overlapped or not, reproduces the reference loop under
    the coupled rule, which every seeded request gets."""
    prompts = [random_prompts(1, seed=100 + seed)[0] for seed in range(6)]
    with Client(sequential_address, timeout_s=60) as sequential:
        assert_seeded_requests_equal_the_reference([client, sequential], *models, prompts, MAX_NEW)


def test_seeded_sampled_output_is_plain_decoding_whatever_the_blocks(client, adaptive_address, models):
    """A seeded request is decoded under the coupled rule: its tokens are the in-process target-only decoder's
    under that rule, for every γ (0 included), with adaptive γ on and off, with the model and the n-gram drafter."""
    target, _ = models
    speculated = 0
    with Client(adaptive_address, timeout_s=60) as adaptive:
        for seed in range(3):
            prompt = random_prompts(1, seed=200 + seed)[0]
            params = SamplingParams(temperature=0.8, top_p=0.95, seed=seed, rule=SamplingRule.COUPLED)
            expected = target_only_generate(target, prompt, params, MAX_NEW).token_ids
            for coordinator in (client, adaptive):
                for method in (common_pb2.DRAFT_METHOD_MODEL, common_pb2.DRAFT_METHOD_NGRAM):
                    for gamma in (0, 1, 4, MAX_GAMMA):
                        reply = coordinator.generate(
                            prompt,
                            max_new_tokens=MAX_NEW,
                            temperature=0.8,
                            top_p=0.95,
                            seed=seed,
                            num_speculative_tokens=gamma,
                            draft_method=method,
                            include_stats=True,
                        )
                        assert list(reply.token_ids) == expected, f"seed {seed}, γ {gamma}, method {method}"
                        assert reply.stats.sampling_rule == COUPLED
                        speculated += reply.stats.drafted_tokens > reply.stats.accepted_tokens > 0
    assert speculated > 0  # some rounds accepted drafts and some rejected them


def test_unseeded_requests_get_the_coordinators_rule_and_coupled_rounds_send_no_q(client, sequential_address):
    """The coordinator's default for unseeded requests is the rejection rule, whose rounds carry the draft's q
    (from the drafter, then to the verifier); coupled rounds carry none. Sequential mode, so that a round's
    bytes are one Propose and one Verify (pre-drafts add lanes, which coupled requests get more of)."""
    kwargs = dict(max_new_tokens=MAX_NEW, temperature=1.0, num_speculative_tokens=4, include_stats=True)
    with Client(sequential_address, timeout_s=60) as sequential:
        unseeded = sequential.generate([3, 8, 1], **kwargs).stats
        seeded = sequential.generate([3, 8, 1], seed=5, **kwargs).stats
    assert (unseeded.sampling_rule, seeded.sampling_rule) == (REJECTION, COUPLED)
    q_bytes = 2 * 4 * 64  # a float32 q row of the tiny vocabulary, sent twice, per drafted token
    assert unseeded.wire_bytes > q_bytes * unseeded.drafted_tokens
    assert 0 < seeded.wire_bytes < q_bytes * seeded.drafted_tokens / 4
    assert client.generate([3, 8, 1], max_new_tokens=4, include_stats=True).stats.sampling_rule == REJECTION


def test_the_drafter_sends_q_only_under_the_rejection_rule(stack):
    sampling = sampling_to_proto(SamplingParams(temperature=0.8, seed=3))
    with grpc.insecure_channel(stack.services["draft"].address) as channel:
        drafter = drafter_pb2_grpc.DrafterStub(channel)
        for rule, rows in ((common_pb2.SAMPLING_RULE_UNSPECIFIED, 3), (REJECTION, 3), (COUPLED, 0)):
            session_id = f"rule-{rule}"
            drafter.OpenSession(
                drafter_pb2.OpenDraftSessionRequest(
                    session_id=session_id, prompt_token_ids=[4, 5, 6], sampling=sampling, sampling_rule=rule
                ),
                timeout=30,
            )
            reply = drafter.Propose(
                drafter_pb2.ProposeRequest(session_id=session_id, base_len=3, num_speculative_tokens=3), timeout=30
            )
            drafter.CloseSession(common_pb2.CloseSessionRequest(session_id=session_id), timeout=30)
            assert len(reply.draft_token_ids) == 3 and reply.draft_probs.rows == rows
        with pytest.raises(grpc.RpcError) as raised:
            drafter.OpenSession(
                drafter_pb2.OpenDraftSessionRequest(
                    session_id="rule-bad", prompt_token_ids=[4], sampling=sampling, sampling_rule=7
                ),
                timeout=30,
            )
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling_rule" in raised.value.details()


def test_a_conversation_is_rendered_by_the_chat_template_and_answered_as_the_target_would(client, models):
    target, _ = models
    conversation = [{"role": "system", "content": "w9 w10"}, {"role": "user", "content": "w11 w12 w13"}]
    prompt = target.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    expected = target_only_generate(target, prompt["input_ids"], SamplingParams(), MAX_NEW).token_ids
    reply = client.generate(messages=conversation, max_new_tokens=MAX_NEW, include_stats=True)
    assert list(reply.token_ids) == expected and reply.stats.prompt_tokens == len(prompt["input_ids"])


def test_overlap_reports_predraft_hits(client):
    reply = client.generate([3, 4, 5], max_new_tokens=60, num_speculative_tokens=2, include_stats=True)
    stats = reply.stats
    assert stats.predraft_attempts > 0 and 0 <= stats.predraft_hits <= stats.predraft_attempts
    assert stats.predraft_guesses > stats.predraft_attempts  # "all accepted" and rejection guesses, side by side
    assert stats.chained_rounds >= stats.predraft_hits  # a hit's block ran on the verifier without a round trip


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(prompt=""), "text"),
        (dict(prompt=[]), "token_ids.ids"),
        (dict(prompt=[1] * 300), "prompt"),
        (dict(prompt=[1, 99]), "token_ids.ids"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=-3), "max_new_tokens"),
        (dict(max_new_tokens=201), "max_new_tokens"),
        (dict(temperature=-0.5), "sampling.temperature"),
        (dict(top_p=0.0), "sampling.top_p"),
        (dict(top_p=1.5), "sampling.top_p"),
        (dict(top_k=-1), "sampling.top_k"),
        (dict(num_speculative_tokens=-1), "num_speculative_tokens"),
        (dict(num_speculative_tokens=99), "num_speculative_tokens"),
        (dict(prompt=None), "prompt"),
        (dict(prompt="w1", messages=[{"role": "user", "content": "w2"}]), "messages"),
        (dict(prompt=None, messages=[{"role": "tool", "content": "w2"}]), "messages"),
        (dict(prompt=None, messages=[{"role": "", "content": "w2"}]), "messages[0].role"),
    ],
)
def test_bad_input_is_invalid_argument_naming_the_field(client, kwargs, field):
    args = {"prompt": [1, 2, 3], "max_new_tokens": 5, **kwargs}
    with pytest.raises(grpc.RpcError) as raised:
        client.generate(args.pop("prompt"), **args)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details().startswith(field), raised.value.details()


def test_unknown_session_is_not_found(stack):
    with grpc.insecure_channel(stack.services["draft"].address) as channel:
        stub = drafter_pb2_grpc.DrafterStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            stub.Propose(
                drafter_pb2.ProposeRequest(session_id="nope", base_len=1, num_speculative_tokens=2), timeout=10
            )
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND and "session_id" in raised.value.details()


def active_sessions(stack) -> tuple[int, int]:
    counts = []
    for name, stub_type in (("draft", drafter_pb2_grpc.DrafterStub), ("verify", verifier_pb2_grpc.VerifierStub)):
        with grpc.insecure_channel(stack.services[name].address) as channel:
            counts.append(stub_type(channel).Info(common_pb2.InfoRequest(), timeout=10).active_sessions)
    return counts[0], counts[1]


def test_cancelled_stream_leaves_no_session_behind(stack, client):
    stream = client.stream([2, 4, 6], max_new_tokens=200, num_speculative_tokens=1)
    next(stream)  # the request is running: both sessions are open
    stream.cancel()
    deadline = time.monotonic() + 20
    while active_sessions(stack) != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert active_sessions(stack) == (0, 0)
    assert client.generate([1, 2], max_new_tokens=3).token_ids  # still serving


def test_guess_lanes_end_right_after_hits_and_misses(stack):
    """Pre-drafts on lanes, one per guessed verdict (coordinator/verdict_guesses.py), over the raw RPCs: whatever the
    verdict, the lane that drafts next (the selected guess's on a hit, the nearest one after a miss) returns
    exactly the block a fresh session opened on the committed sequence drafts, and so does the verifier."""
    params = SamplingParams()  # greedy: the draft's runner-up is often the verifier's token, so guesses hit
    lanes_count = 1 + LANES_GAMMA
    outcomes = {"hit": 0, "miss": 0}
    with (
        grpc.insecure_channel(stack.services["draft"].address) as draft_channel,
        grpc.insecure_channel(stack.services["verify"].address) as verify_channel,
    ):
        drafter = drafter_pb2_grpc.DrafterStub(draft_channel)
        verifier = verifier_pb2_grpc.VerifierStub(verify_channel)
        for attempt, prompt in enumerate(random_prompts(6, seed=9)):
            sampling = sampling_to_proto(params)
            session_id = f"lanes-{attempt}"
            drafter.OpenSession(
                drafter_pb2.OpenDraftSessionRequest(
                    session_id=session_id, prompt_token_ids=prompt, sampling=sampling, num_lanes=lanes_count
                ),
                timeout=30,
            )
            verifier.OpenSession(
                verifier_pb2.OpenVerifySessionRequest(
                    session_id=session_id, prompt_token_ids=prompt, sampling=sampling
                ),
                timeout=30,
            )
            lanes = [DraftLane(i, list(prompt), len(prompt)) for i in range(lanes_count)]
            committed = list(prompt)

            def propose(calls: list[tuple[DraftLane, list[int], int]]) -> list[drafter_pb2.ProposeResponse]:
                request = drafter_pb2.ProposeLanesRequest(
                    session_id=session_id,
                    lanes=[
                        drafter_pb2.LaneProposal(
                            lane=lane.index,
                            base_len=lane.sync_to(seq)[0],
                            appended_token_ids=lane.sync_to(seq)[1],
                            num_speculative_tokens=n,
                            num_alternatives=1,
                        )
                        for lane, seq, n in calls
                    ],
                )
                replies = list(drafter.ProposeLanes(request, timeout=30).lanes)
                for (lane, seq, _), reply in zip(calls, replies):
                    lane.synced(seq, list(reply.draft_token_ids), len(committed))
                return replies

            [block] = propose([(lanes[0], list(committed), LANES_GAMMA)])
            block_lane = lanes[0]
            for _ in range(8):
                tokens = list(block.draft_token_ids)
                alternatives = [list(block.alternative_token_ids[i : i + 1]) for i in range(len(tokens))]
                guessed = guesses(tokens, alternatives, 1)
                free = iter(lane for lane in lanes if lane is not block_lane)
                calls = [
                    (
                        block_lane if g.next_token is None else next(free),
                        g.sequence(committed, tokens),
                        LANES_GAMMA + 1 if g.next_token is None else LANES_GAMMA,
                    )
                    for g in guessed
                ]
                verdict_future = verifier.Verify.future(
                    verifier_pb2.VerifyRequest(
                        session_id=session_id,
                        base_len=len(committed),
                        draft_token_ids=tokens,
                        draft_probs=block.draft_probs,
                    ),
                    timeout=30,
                )
                predrafts = propose(calls)  # while the verifier works
                verdict = verdict_future.result()
                committed += [*verdict.accepted_token_ids, verdict.next_token_id]
                selected = [
                    (call, reply)
                    for g, call, reply in zip(guessed, calls, predrafts)
                    if g.verdict(reply.draft_token_ids) == (len(verdict.accepted_token_ids), verdict.next_token_id)
                ]
                fresh_id = f"{session_id}-fresh-{len(committed)}"
                drafter.OpenSession(
                    drafter_pb2.OpenDraftSessionRequest(
                        session_id=fresh_id, prompt_token_ids=committed, sampling=sampling
                    ),
                    timeout=30,
                )
                fresh = drafter.Propose(
                    drafter_pb2.ProposeRequest(
                        session_id=fresh_id,
                        base_len=len(committed),
                        num_speculative_tokens=LANES_GAMMA,
                        num_alternatives=1,
                    ),
                    timeout=30,
                )
                drafter.CloseSession(common_pb2.CloseSessionRequest(session_id=fresh_id), timeout=30)
                if selected:
                    outcomes["hit"] += 1
                    (block_lane, _, _), reply = selected[0]
                    skip = 1 if block_lane is calls[0][0] else 0  # "all accepted" drafted the bonus token first
                    assert list(reply.draft_token_ids[skip : skip + LANES_GAMMA]) == list(fresh.draft_token_ids)
                    assert list(reply.alternative_token_ids[skip : skip + LANES_GAMMA]) == list(
                        fresh.alternative_token_ids
                    )
                    block = fresh
                else:
                    outcomes["miss"] += 1
                    block_lane = max(lanes, key=lambda lane: lane.sync_to(committed)[0])
                    [block] = propose([(block_lane, list(committed), LANES_GAMMA)])
                    assert list(block.draft_token_ids) == list(fresh.draft_token_ids)
                    assert list(block.alternative_token_ids) == list(fresh.alternative_token_ids)
            assert verdict.session_len == len(committed)
            drafter.CloseSession(common_pb2.CloseSessionRequest(session_id=session_id), timeout=30)
            verifier.CloseSession(common_pb2.CloseSessionRequest(session_id=session_id), timeout=30)
    assert outcomes["hit"] > 0 and outcomes["miss"] > 0, outcomes


@pytest.mark.parametrize("gamma", [0, 3])
def test_a_constraint_the_vocabulary_cannot_meet_ends_at_its_dead_end(client, sequential_address, gamma):
    """The word vocabulary cannot spell 'x': after 'w1' the regex allows no token, so the request ends there,
    streamed or not, overlapped or not."""
    constraint = common_pb2.Constraint(regex="w1x")
    with Client(sequential_address) as sequential:
        for caller in (client, sequential):
            reply = caller.generate([5, 6], max_new_tokens=MAX_NEW, num_speculative_tokens=gamma, constraint=constraint)
            assert list(reply.token_ids) == [1]
            assert reply.finish_reason == coordinator_pb2.FINISH_REASON_CONSTRAINT_DEAD_END
            chunks = list(
                caller.stream([5, 6], max_new_tokens=MAX_NEW, num_speculative_tokens=gamma, constraint=constraint)
            )
            assert [t for c in chunks for t in c.token_ids] == [1]
            assert chunks[-1].finish_reason == coordinator_pb2.FINISH_REASON_CONSTRAINT_DEAD_END
