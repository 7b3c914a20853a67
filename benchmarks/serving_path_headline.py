"""The serving path's floors, from a serving_path report's figures: each with its two figures, ratio and `meets`.

- plain through the stack >= 0.95x the ideal plain decoding (one target step per token, in process) at c1;
- speculative over the ideal plain >= 1.2x the sequential bound E/(1+γc) at its best γ, at c1;
- speculative >= 1.3x plain throughput at c16 and >= 1.0x at c64;
- time to first token with speculation <= 1.05x plain's at c1 (p50) and <= 1.1x at every concurrency (p99).
"""

from __future__ import annotations

from collections.abc import Sequence

FLOORS = {
    "plain_vs_ideal_c1": 0.95,
    "spec_speedup_vs_sequential_bound_c1": 1.2,
    "spec_vs_plain_throughput_c16": 1.3,
    "spec_vs_plain_throughput_c64": 1.0,
    "ttft_p50_spec_vs_plain_c1": 1.05,
    "ttft_p99_spec_vs_plain_worst": 1.1,
}
CEILINGS = {"ttft_p50_spec_vs_plain_c1", "ttft_p99_spec_vs_plain_worst"}  # ratios that must stay at or below


def expected_tokens(alpha: float, gamma: int) -> float:
    """E(γ) = (1 - α^(γ+1)) / (1 - α): tokens a round of γ drafted tokens commits."""
    return gamma + 1.0 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def best_bounds(alpha: float, c: float, max_gamma: int = 16) -> dict:
    """The sequential bound E/(1+γc) and the overlapped ceiling E/max(1, γc), each at its best γ in 1..max_gamma."""
    gammas = range(1, max_gamma + 1)
    sequential = max(gammas, key=lambda g: expected_tokens(alpha, g) / (1 + g * c))
    overlapped = max(gammas, key=lambda g: expected_tokens(alpha, g) / max(1.0, g * c))
    return {
        "sequential_bound": round(expected_tokens(alpha, sequential) / (1 + sequential * c), 4),
        "sequential_gamma": sequential,
        "overlapped_ceiling": round(expected_tokens(alpha, overlapped) / max(1.0, overlapped * c), 4),
        "overlapped_gamma": overlapped,
    }


def _entry(name: str, numerator: tuple[str, float], denominator: tuple[str, float]) -> dict:
    ratio = numerator[1] / denominator[1] if denominator[1] else None
    floor = FLOORS[name]
    meets = None if ratio is None else (ratio <= floor if name in CEILINGS else ratio >= floor)
    return {
        "ratio": None if ratio is None else round(ratio, 4),
        "numerator": {"figure": numerator[0], "value": round(numerator[1], 4)},
        "denominator": {"figure": denominator[0], "value": round(denominator[1], 4)},
        "floor": floor,
        "kind": "at most" if name in CEILINGS else "at least",
        "meets": meets,
    }


def headline(
    ideal_plain_tps: float, levels: dict[int, dict[str, dict]], alpha: float, c: float, concurrencies: Sequence[int]
) -> dict:
    """The floors from medians: `levels[c][mode]` holds `tps`, `ttft_p50_ms`, `ttft_p99_ms` of mode spec or plain
    at concurrency c. Floors whose concurrency was not run are left out."""
    entries = {}
    c1 = levels.get(1)
    if c1:
        entries["plain_vs_ideal_c1"] = _entry(
            "plain_vs_ideal_c1", ("plain tok/s c1", c1["plain"]["tps"]), ("ideal plain tok/s", ideal_plain_tps)
        )
        bounds = best_bounds(alpha, c)
        speedup = c1["spec"]["tps"] / ideal_plain_tps
        entries["spec_speedup_vs_sequential_bound_c1"] = {
            **_entry(
                "spec_speedup_vs_sequential_bound_c1",
                ("spec tok/s c1 / ideal plain tok/s", speedup),
                (f"E/(1+γc), α {alpha:.3f}, c {c:.3f}, γ {bounds['sequential_gamma']}", bounds["sequential_bound"]),
            ),
            **bounds,
        }
        entries["ttft_p50_spec_vs_plain_c1"] = _entry(
            "ttft_p50_spec_vs_plain_c1",
            ("spec TTFT p50 ms c1", c1["spec"]["ttft_p50_ms"]),
            ("plain TTFT p50 ms c1", c1["plain"]["ttft_p50_ms"]),
        )
    for level in (16, 64):
        if level in levels:
            name = f"spec_vs_plain_throughput_c{level}"
            entries[name] = _entry(
                name,
                (f"spec tok/s c{level}", levels[level]["spec"]["tps"]),
                (f"plain tok/s c{level}", levels[level]["plain"]["tps"]),
            )
    worst = max(concurrencies, key=lambda k: levels[k]["spec"]["ttft_p99_ms"] / levels[k]["plain"]["ttft_p99_ms"])
    entries["ttft_p99_spec_vs_plain_worst"] = {
        **_entry(
            "ttft_p99_spec_vs_plain_worst",
            (f"spec TTFT p99 ms c{worst}", levels[worst]["spec"]["ttft_p99_ms"]),
            (f"plain TTFT p99 ms c{worst}", levels[worst]["plain"]["ttft_p99_ms"]),
        ),
        "concurrency": worst,
    }
    return entries
