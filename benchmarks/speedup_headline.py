"""The speedup benchmark's headline: four ratios of the gRPC stack against what a user would otherwise run.

Every ratio is taken per temperature and per prompt set from the medians of one run, and keeps the two
tokens/s figures it came from, its floor, and whether it meets it (reported as measured, pass or fail):

- `stack_vs_target_only_same_verifier`: the stack (overlapped rounds, verify service on one core, draft
  service on the other) over the faster of HF `generate` and the project's own plain loop, target alone on
  the verifier's core (one torch thread);
- `stack_vs_hf_assisted_same_verifier`: the same stack over HF assisted generation with target and draft
  sharing that one core;
- `stack_vs_hf_assisted_all_cores`: the same stack over HF assisted generation on every core;
- `plain_stack_vs_in_process`: the stack's γ 0 path (plain decoding through the coordinator) over the
  project's in-process plain loop on the verifier's core.
"""

from __future__ import annotations

from benchmarks.speedup_report import TARGET_ONLY

STACK = "grpc_overlap"
PLAIN_STACK = "grpc_plain"
FLOORS = {
    "stack_vs_target_only_same_verifier": 2.0,
    "stack_vs_hf_assisted_same_verifier": 1.5,
    "stack_vs_hf_assisted_all_cores": 1.0,
    "plain_stack_vs_in_process": 0.97,
}
HEADLINE_PROMPT_SET = "code"
HEADLINE_TEMPERATURE = "greedy"


def _pairs(tokens_per_s: dict[str, float]) -> dict[str, tuple[str, str]]:
    """Ratio key -> (numerator contender, denominator contender)."""
    best_target_only = max(TARGET_ONLY, key=lambda name: tokens_per_s[name])
    return {
        "stack_vs_target_only_same_verifier": (STACK, best_target_only),
        "stack_vs_hf_assisted_same_verifier": (STACK, "hf_assisted"),
        "stack_vs_hf_assisted_all_cores": (STACK, "hf_assisted_all_cores"),
        "plain_stack_vs_in_process": (PLAIN_STACK, "own_target_only"),
    }


def ratios(tokens_per_s: dict[str, float]) -> dict[str, dict]:
    """The four ratios from one temperature's and one prompt set's median tokens/s by contender."""
    out = {}
    for key, (numerator, denominator) in _pairs(tokens_per_s).items():
        top, bottom = tokens_per_s[numerator], tokens_per_s[denominator]
        ratio = top / bottom if bottom else 0.0
        out[key] = {
            "ratio": ratio,
            "numerator": {"contender": numerator, "tokens_per_s": top},
            "denominator": {"contender": denominator, "tokens_per_s": bottom},
            "floor": FLOORS[key],
            "meets": ratio >= FLOORS[key],
        }
    return out


def headline(tokens_per_s_by_set: dict[str, dict[str, dict[str, float]]], top_set: str = HEADLINE_PROMPT_SET) -> dict:
    """prompt set -> temperature -> contender -> tokens/s, into the report's `headline` object:
    `headline[temperature][prompt_set][key]`, and the greedy figures of `top_set` at the top."""
    by_temperature: dict[str, dict[str, dict]] = {}
    for prompt_set, by_label in tokens_per_s_by_set.items():
        for label, tokens_per_s in by_label.items():
            by_temperature.setdefault(label, {})[prompt_set] = ratios(tokens_per_s)
    top = by_temperature[HEADLINE_TEMPERATURE][top_set]
    return {
        "prompt_set": top_set,
        "temperature": HEADLINE_TEMPERATURE,
        **top,
        "floors": FLOORS,
        **by_temperature,
    }


def headline_table(report_headline: dict) -> str:
    """One line per temperature and prompt set: each ratio, its floor and whether it meets it."""
    lines = ["headline ratios (ratio / floor, ✓ meets):"]
    for label, by_set in report_headline.items():
        if not isinstance(by_set, dict) or label == "floors" or label in FLOORS:
            continue
        for prompt_set, figures in by_set.items():
            cells = [
                f"{key} {f['ratio']:.2f}/{f['floor']:.2f} {'✓' if f['meets'] else '✗'}" for key, f in figures.items()
            ]
            lines.append(f"  {label:<13} {prompt_set:<8} " + ", ".join(cells))
    return "\n".join(lines)
