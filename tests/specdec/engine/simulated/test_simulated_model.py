"""A model on the twin: passes take the profile's modelled time, the KV pool is the profile's, the synthetic target
is deterministic and never cycles, the draft agrees with it at the requested rate, and speculative decoding on the
pair is exact."""

from __future__ import annotations

import time

import pytest
from twin_models import load_twin

from specdec.decoding.reference_loop import speculative_generate, target_only_generate
from specdec.engine.kv.session import KVSession
from specdec.engine.model_runtime import ModelSettings
from specdec.engine.simulated.cost_model import PassRow
from specdec.engine.simulated.loading import load_simulated
from specdec.engine.simulated.profiles import parse_twin_device
from specdec.sampling.rules import SamplingParams

PROMPT = list(range(100, 164))
TIME_TOLERANCE = 0.10
# (profile, role) per shape of pass: (rows, tokens each, cached positions each, logits kept each)
PASSES = {"decode": (1, 1, 200, 1), "verify block": (1, 5, 200, 5), "16 rows": (16, 5, 300, 5)}


def wall_time_of_passes(model, rows: int, tokens: int, cached: int, kept: int, repeats: int = 9) -> float:
    """The shortest wall time of `repeats` passes over `rows` rows, each rolled back after: a busy machine only ever
    adds host time to a pass, so the least disturbed one shows what the twin waits."""
    sessions = [KVSession(model, [7] * cached) for _ in range(rows)]
    for session in sessions:
        session.prefill()
    times = []
    for _ in range(repeats):
        batch = [(list(range(1, tokens + 1)), session.cache, kept) for session in sessions]
        started = time.perf_counter()
        model.forward_rows(batch)
        times.append(time.perf_counter() - started)
        for session in sessions:
            session.cache.crop(-tokens)
    return min(times)


@pytest.mark.parametrize("profile", ["llama70b-tp4-h100", "llama8b-h100"])
@pytest.mark.parametrize("role", ["target", "draft"])
@pytest.mark.parametrize("shape", sorted(PASSES))
def test_a_pass_takes_its_profiles_time(twin_cache, profile, role, shape):
    model = load_twin(role, f"sim:{profile}:8192")
    rows, tokens, cached, kept = PASSES[shape]
    modelled = model.cost.seconds([PassRow(tokens, cached, kept)] * rows)
    measured = wall_time_of_passes(model, rows, tokens, cached, kept)
    assert measured == pytest.approx(modelled, rel=TIME_TOLERANCE), (
        f"{measured * 1e3:.2f} ms, modelled {modelled * 1e3:.2f}"
    )


def test_the_kv_pool_is_sized_by_the_profile(twin_cache):
    model = load_twin("target", "sim:llama70b-tp4-h100:8192", kv_cache_budget=0.5)
    placement = parse_twin_device("sim:llama70b-tp4-h100").profile.target
    per_block = placement.model.kv_bytes_per_position * 16
    assert model.kv_pool.blocks.num_blocks == int(0.5 * placement.free_memory_bytes // per_block)
    assert load_twin("target", kv_cache_budget=64 * 131072 * 16).kv_pool.blocks.num_blocks == 64  # bytes


def test_logits_are_a_function_of_the_context_alone(twin_pair, twin_cache):
    target, _ = twin_pair
    first = KVSession(target, PROMPT)
    first.prefill()
    ahead = first.extend([5, 6, 7])  # [4, V]
    first.truncate(len(PROMPT) + 1)  # roll back two tokens, feed them again in another pass
    again = first.extend([6, 7])
    fresh = KVSession(load_twin("target"), PROMPT)  # another instance, as another process would build it
    fresh.prefill()
    fork = fresh.fork()
    assert (again == ahead[1:]).all()
    assert (fork.extend([5, 6, 7]) == ahead).all()
    assert not (fresh.extend([5, 6, 8])[-1] == ahead[-1]).all()  # the last token counts


def test_greedy_decoding_never_cycles(twin_pair):
    target, _ = twin_pair
    tokens = target_only_generate(target, PROMPT, SamplingParams(), 512).token_ids
    assert len(tokens) == 512  # no end-of-sequence: a twin's completions run to their budget
    tail = tokens[128:]
    periods = [p for p in range(1, 65) if all(tail[i] == tail[i + p] for i in range(len(tail) - p))]
    assert periods == []
    assert len(set(tokens)) > 400


@pytest.mark.parametrize("acceptance", [0.6, 0.75, 0.85])
def test_the_draft_is_accepted_at_the_calibrated_rate(twin_pair, acceptance):
    """At γ 1 every drafted token is judged, so accepted / drafted is the per-token rate (~700 tokens: σ 0.017)."""
    target = twin_pair[0]
    draft = load_twin("draft", acceptance=acceptance)
    accepted = drafted = 0
    for index in range(10):
        prompt = [(31 * index + t) % 8000 + 1 for t in range(40)]
        stats = speculative_generate(target, draft, prompt, 1, SamplingParams(), 128).stats
        accepted, drafted = accepted + stats.accepted, drafted + stats.drafted
    assert accepted / drafted == pytest.approx(acceptance, abs=0.05)


def test_speculative_greedy_on_the_twin_is_the_target_alone(twin_pair):
    target, draft = twin_pair
    expected = target_only_generate(target, PROMPT, SamplingParams(), 80).token_ids
    for gamma in (1, 4, 7):
        assert speculative_generate(target, draft, PROMPT, gamma, SamplingParams(), 80).token_ids == expected


def test_a_service_must_name_its_role(twin_cache):
    with pytest.raises(ValueError, match="^model: .* pass --model draft, got 'target'"):
        load_simulated(ModelSettings("target", device="sim:llama8b-h100:8192"), "draft", 0.75, 0)
