"""The twin benchmark's analytic references and its headline: each floor of the twin's figures with the two figures
it compares and whether it is met, reported as measured.

References from the cost model alone: the twin's *ideal plain decoding* (a prefill, then one modelled step per
further token, nothing between the passes), c = a draft step over a target step, and the sequential bound
E / (1 + γc) and overlapped ceiling E / max(1, γc), each at the γ that maximises it for the calibrated α.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from benchmarks.speedup_report import overlapped_ceiling, speedup_bound
from specdec.engine.simulated.cost_model import CostModel
from specdec.engine.simulated.profiles import Profile

MAX_GAMMA = 10
AT_LEAST, AT_MOST = "at_least", "at_most"
# key -> (floor, which side of it meets); throughput figures must reach theirs, time-to-first-token ones stay under
FLOORS = {
    "plain_vs_ideal_c1": (0.95, AT_LEAST),
    "speculative_vs_sequential_bound_c1": (1.2, AT_LEAST),
    "speculative_vs_sequential_bound_c1_delay_0.5ms": (1.0, AT_LEAST),
    "speculative_vs_plain_throughput_c16": (1.3, AT_LEAST),
    "speculative_vs_plain_throughput_c64": (1.0, AT_LEAST),
    "ttft_p50_speculative_vs_plain_c1": (1.05, AT_MOST),
    "ttft_p99_speculative_vs_plain_worst": (1.1, AT_MOST),
}
TTFT_FLOORS = ("ttft_p50_speculative_vs_plain_c1", "ttft_p99_speculative_vs_plain_worst")


def analytic(profile: Profile, alpha: float, context: int) -> dict:
    """Step times at `context` cached positions, c, and the best-γ bound and ceiling for α."""
    target_ms = CostModel(profile.target).decode_step_s(context) * 1e3
    draft_ms = CostModel(profile.draft).decode_step_s(context) * 1e3
    c = draft_ms / target_ms
    gammas = range(1, MAX_GAMMA + 1)
    bound_gamma = max(gammas, key=lambda g: speedup_bound(alpha, g, c))
    ceiling_gamma = max(gammas, key=lambda g: overlapped_ceiling(alpha, g, c))
    return {
        "alpha": alpha,
        "context_positions": context,
        "target_step_ms": round(target_ms, 4),
        "draft_step_ms": round(draft_ms, 4),
        "c": round(c, 4),
        "sequential_bound": {"gamma": bound_gamma, "speedup": round(speedup_bound(alpha, bound_gamma, c), 4)},
        "overlapped_ceiling": {
            "gamma": ceiling_gamma,
            "speedup": round(overlapped_ceiling(alpha, ceiling_gamma, c), 4),
        },
    }


def ideal_plain_tokens_per_s(profile: Profile, prompt_lengths: Sequence[int], new_tokens: int) -> float:
    """Tokens/s of the twin's ideal plain decoding over the prompts, one request after another."""
    model = CostModel(profile.target)
    seconds = sum(model.plain_decoding_s(length, new_tokens) for length in prompt_lengths)
    return len(prompt_lengths) * new_tokens / seconds


def median_tokens_per_s(passes: Sequence[dict]) -> float:
    return statistics.median(p["tokens_per_s"] for p in passes)


def entry(key: str, numerator: tuple[str, float], denominator: tuple[str, float], scale: float = 1.0) -> dict:
    """A headline entry: ratio = numerator / (denominator × scale), its floor and whether it is met."""
    floor, side = FLOORS[key]
    ratio = numerator[1] / (denominator[1] * scale) if denominator[1] else 0.0
    return {
        "ratio": round(ratio, 4),
        "numerator": {"figure": numerator[0], "value": round(numerator[1], 4)},
        "denominator": {"figure": denominator[0], "value": round(denominator[1] * scale, 4)},
        "floor": floor,
        "meets": ratio >= floor if side == AT_LEAST else ratio <= floor,
        "side": side,
        "simulated": True,
    }


def concurrency_1_entries(c1: dict, analysis: dict) -> dict:
    """The concurrency-1 floors from the runs' medians (c1: delay label -> figures, with 'ideal_plain')."""
    ideal = c1["ideal_plain_tokens_per_s"]
    bound = analysis["sequential_bound"]["speedup"]
    entries = {
        "plain_vs_ideal_c1": entry(
            "plain_vs_ideal_c1", ("plain tokens/s, delay 0", c1["0"]["plain"]["tokens_per_s"]), ("ideal plain", ideal)
        )
    }
    for delay, key in (("0", "speculative_vs_sequential_bound_c1"), ("0.5", FLOOR_AT_HALF_MS)):
        if delay in c1:
            spec = c1[delay]["speculative"]["tokens_per_s"]
            entries[key] = entry(
                key, (f"speculative tokens/s, delay {delay} ms", spec), ("ideal plain × sequential bound", ideal), bound
            )
    return entries


FLOOR_AT_HALF_MS = "speculative_vs_sequential_bound_c1_delay_0.5ms"


def sweep_entries(levels: dict, name: str = "twin") -> dict:
    """The floors of a concurrency sweep (levels: 'c<N>' -> mode -> figures); only those whose levels ran."""
    entries = {}
    for concurrency, key in ((16, "speculative_vs_plain_throughput_c16"), (64, "speculative_vs_plain_throughput_c64")):
        level = levels.get(f"c{concurrency}")
        if level:
            entries[key] = entry(
                key,
                (f"speculative tokens/s at c{concurrency}", level["spec"]["tokens_per_s"]),
                (f"plain tokens/s at c{concurrency}", level["plain"]["tokens_per_s"]),
            )
    if "c1" in levels:
        key = "ttft_p50_speculative_vs_plain_c1"
        entries[key] = entry(
            key,
            ("speculative TTFT p50 ms at c1", levels["c1"]["spec"]["ttft_p50_ms"]),
            ("plain TTFT p50 ms at c1", levels["c1"]["plain"]["ttft_p50_ms"]),
        )
    worst = max(levels, key=lambda label: levels[label]["spec"]["ttft_p99_ms"] / levels[label]["plain"]["ttft_p99_ms"])
    key = "ttft_p99_speculative_vs_plain_worst"
    entries[key] = entry(
        key,
        (f"speculative TTFT p99 ms at {worst}", levels[worst]["spec"]["ttft_p99_ms"]),
        (f"plain at {worst}", levels[worst]["plain"]["ttft_p99_ms"]),
    )
    return entries
