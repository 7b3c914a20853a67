"""What judging one verify step's rounds costs: one round at a time (logits_to_probs + sample_verdict, reading
values back as it goes) against all rounds at once on the device (round_judge.judge_rounds, one read back).

Synthetic logits of the demo pair's width (8,192 ids), γ 4, on one thread; per rule (greedy, the rejection rule with
a dense q, the coupled rule) and number of rounds, the median of `--repeats` timings of each way, taken alternately.
Both ways give the same verdicts (checked on every sample). On a GPU the batched way also saves a device wait per
read; this measures the CPU cost alone.

    python -m benchmarks.judge_cost                  # writes benchmarks/results/judge_cost.json
    python -m benchmarks.judge_cost --quick          # fewer repeats, to a temporary folder
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
import time

import torch

from benchmarks.stack_runs import environment, results_dir, write_json
from specdec.sampling.round_judge import DraftRound, judge_rounds
from specdec.sampling.rules import SamplingParams, SamplingRule, logits_to_probs, sample_verdict

VOCAB = 8192
GAMMA = 4
RULES = {
    "greedy": SamplingParams(),
    "rejection": SamplingParams(temperature=1.0, top_p=0.95, rule=SamplingRule.REJECTION),
    "coupled": SamplingParams(temperature=1.0, top_p=0.95, rule=SamplingRule.COUPLED),
}


def step_rounds(rule: str, rows: int, seed: int) -> tuple[list[DraftRound], list[torch.Tensor]]:
    """`rows` rounds of γ drafted tokens with their target logits [γ+1, V], rows of one tensor as a packed pass gives
    them (and q under the rejection rule)."""
    generator = torch.Generator().manual_seed(seed)
    params = RULES[rule]
    packed = torch.randn((rows * (GAMMA + 1), VOCAB), generator=generator) * 4  # [K, V], as one pass returns them
    rounds, logits = [], []
    for row, target in enumerate(packed.split(GAMMA + 1)):  # [γ+1, V] each
        q = (target[:GAMMA] + torch.randn((GAMMA, VOCAB), generator=generator)).softmax(dim=-1)  # [γ, V]
        drafted = target[:GAMMA].argmax(dim=-1).tolist()  # mostly accepted, as a good draft's would be
        params_row = dataclasses.replace(params, seed=seed * 1000 + row)
        rounds.append(DraftRound(drafted, q if rule == "rejection" else None, params_row, 100 + row))
        logits.append(target)
    return rounds, logits


def one_at_a_time(rounds: list[DraftRound], logits: list[torch.Tensor]) -> list:
    return [
        sample_verdict(r.draft_tokens, r.draft_probs, logits_to_probs(row, r.params), r.params, r.start_position)
        for r, row in zip(rounds, logits)
    ]


def timed_ms(call) -> tuple[float, object]:
    started = time.perf_counter_ns()
    result = call()
    return (time.perf_counter_ns() - started) / 1e6, result


def measure(rows_list: list[int], repeats: int) -> dict:
    """Per rule and rows: median ms of each way, their ratio, and whether every verdict agreed."""
    figures: dict = {}
    for rule in RULES:
        for rows in rows_list:
            one, batched, same = [], [], True
            for repeat in range(repeats):
                rounds, logits = step_rounds(rule, rows, seed=repeat)
                ms_one, verdicts_one = timed_ms(lambda: one_at_a_time(rounds, logits))
                ms_batched, verdicts_batched = timed_ms(lambda: judge_rounds(rounds, logits))
                one.append(ms_one)
                batched.append(ms_batched)
                same &= verdicts_one == verdicts_batched
            entry = {
                "one_at_a_time_ms": round(statistics.median(one), 3),
                "batched_ms": round(statistics.median(batched), 3),
                "verdicts_identical": same,
            }
            entry["speedup"] = round(entry["one_at_a_time_ms"] / entry["batched_ms"], 2)
            figures.setdefault(rule, {})[str(rows)] = entry
            print(f"{rule:9s} rows {rows:2d}: {entry}", flush=True)
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,16", help="rounds per step, comma-separated")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="3 repeats, written to a temporary folder")
    parser.add_argument("--out-dir", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    repeats = 3 if args.quick else args.repeats
    rows_list = [int(rows) for rows in args.rows.split(",")]
    report = {
        "machine": environment(threads=1),
        "settings": {"vocab": VOCAB, "gamma": GAMMA, "repeats": repeats, "rows": rows_list},
        "rules": measure(rows_list, repeats),
    }
    write_json(results_dir(args.out_dir, args.quick) / "judge_cost.json", report)


if __name__ == "__main__":
    main()
