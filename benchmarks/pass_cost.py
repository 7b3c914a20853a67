"""What one batched verify pass costs against its rows and their cached context: the bound on how much cheaper
per session continuous batching makes the target's work, and so on what batching can gain over one session
per pass.

For each cached context length L and row count R, R sessions holding L tokens each (or, with --context-spread S,
lengths spaced evenly over L ± S/2 in random slot order, as sessions at different points of their requests hold;
the one-row passes hold the length nearest L) score a block of γ drafted tokens (γ + 1 tokens fed per row) in
one packed pass, the forward the verify service runs for a step (`specdec.kv_session.run_forwards`); the block
is then rolled back, so every sample sees the same lengths. The (L, R) points are timed round-robin, `--repeats`
rounds, so drift hits them alike. The report gives per point the median pass time and the batching gain
R × pass(L, 1 row) / pass(L, R rows): how many times less target time a session's round costs in a pass of R
than alone. It leaves out what both ways pay alike (prefills, wire, drafting), so a stack's on/off throughput
ratio stays below it.

    python -m benchmarks.pass_cost                                 # demo target, ~2 min
    python -m benchmarks.pass_cost --contexts 60,240 --rows 1,16 --repeats 5 --out-dir /tmp/pass_cost
    python -m benchmarks.pass_cost --contexts 240 --context-spread 300 --out-dir /tmp/pass_cost_spread
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from specdec.embedded_pair import DEMO_TARGET_DIR
from specdec.kv_session import KVSession, run_forwards
from specdec.model_runtime import LoadedModel, ModelSettings

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"


def _csv_ints(raw: str) -> tuple[int, ...]:
    return tuple(int(part) for part in raw.split(",") if part.strip())


def context_lengths(context: int, spread: int, count: int, rng: random.Random) -> list[int]:
    """count cached lengths spaced evenly over context ± spread / 2 (all `context` when spread is 0): first the one
    nearest the context, which the one-row passes hold, then the others in random order."""
    if count == 1:
        return [context]
    lengths = sorted((round(context - spread / 2 + i * spread / (count - 1)) for i in range(count)),
                     key=lambda length: abs(length - context))
    rest = lengths[1:]
    rng.shuffle(rest)
    return lengths[:1] + rest


def time_passes(model: LoadedModel, contexts: Sequence[int], rows: Sequence[int], gamma: int, repeats: int,
                log: Callable[[str], None] = print, spread: int = 0) -> dict[tuple[int, int], list[float]]:
    """Milliseconds of each timed pass per (context, rows), `repeats` samples each, after one unrecorded round."""
    rng = random.Random(0)
    sessions: dict[int, list[KVSession]] = {}
    for context in contexts:  # max(rows) sessions per context, prefilled one by one
        sessions[context] = [KVSession(model, [rng.randrange(1, model.vocab_size) for _ in range(length)])
                             for length in context_lengths(context, spread, max(rows), rng)]
        for session in sessions[context]:
            session.prefill()
    samples: dict[tuple[int, int], list[float]] = {(context, count): [] for context in contexts for count in rows}
    for repeat in range(repeats + 1):
        for context in contexts:
            for count in rows:
                batch = sessions[context][:count]
                blocks = [[rng.randrange(1, model.vocab_size) for _ in range(gamma)] for _ in batch]
                started = time.perf_counter_ns()
                run_forwards([session.plan_extend(block) for session, block in zip(batch, blocks)])
                elapsed_ms = (time.perf_counter_ns() - started) / 1e6
                for session in batch:
                    session.truncate(len(session) - gamma)
                if repeat:
                    samples[context, count].append(elapsed_ms)
        log(f"round {repeat}/{repeats}" + (" (warm-up, not recorded)" if not repeat else ""))
    return samples


def summarize(samples: dict[tuple[int, int], list[float]], gamma: int) -> list[dict]:
    """Per (context, rows): the median pass in ms, per row, and the batching gain against one row alone."""
    medians = {point: statistics.median(times) for point, times in samples.items()}
    points = []
    for (context, count), median_ms in sorted(medians.items()):
        alone_ms = medians.get((context, 1))
        points.append({"context_tokens": context, "rows": count, "tokens_fed": count * (gamma + 1),
                       "pass_ms": round(median_ms, 2), "per_row_ms": round(median_ms / count, 2),
                       "batching_gain": round(count * alone_ms / median_ms, 2) if alone_ms else None,
                       "samples_ms": [round(t, 2) for t in samples[context, count]]})
    return points


def plot(points: list[dict], path: pathlib.Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (passes, gains) = plt.subplots(1, 2, figsize=(11, 4.2))
    for context in sorted({p["context_tokens"] for p in points}):
        line = [p for p in points if p["context_tokens"] == context]
        passes.plot([p["rows"] for p in line], [p["pass_ms"] for p in line], marker="o", label=f"{context} cached")
        if all(p["batching_gain"] is not None for p in line):
            gains.plot([p["rows"] for p in line], [p["batching_gain"] for p in line], marker="o",
                       label=f"{context} cached")
    rows = sorted({p["rows"] for p in points})
    gains.plot(rows, rows, linestyle=":", color="grey", label="ideal (pass cost flat in rows)")
    passes.set(xlabel="rows (sessions) in the pass", ylabel="median pass ms", title="one verify pass")
    gains.set(xlabel="rows (sessions) in the pass", ylabel="rows × pass(1 row) / pass(rows)", title="batching gain")
    for axes in (passes, gains):
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pass_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(DEMO_TARGET_DIR), help="target model directory")
    parser.add_argument("--contexts", type=_csv_ints, default=(60, 120, 240, 360),
                        help="cached tokens per session, comma-separated [60,120,240,360]")
    parser.add_argument("--rows", type=_csv_ints, default=(1, 2, 4, 8, 16),
                        help="sessions per pass, comma-separated; 1 is the reference of the gain [1,2,4,8,16]")
    parser.add_argument("--context-spread", type=int, default=0,
                        help="sessions' cached lengths spread evenly over each context ± this / 2 [0]")
    parser.add_argument("--gamma", type=int, default=4, help="drafted tokens per row (γ + 1 fed) [4]")
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds over every point [15]")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the verify service's --threads) [1]")
    parser.add_argument("--out-dir", type=pathlib.Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    if not args.contexts or not args.rows or min(args.rows) < 1 or args.gamma < 0 or args.context_spread < 0:
        parser.error("--rows must be >= 1, --gamma >= 0, --context-spread >= 0")
    if min(args.contexts) - args.context_spread / 2 < 2:
        parser.error("every context less half the spread must be >= 2 tokens")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    print(f"loading {args.target} ...", flush=True)
    model = LoadedModel.load(ModelSettings(args.target, threads=args.threads))
    samples = time_passes(model, args.contexts, args.rows, args.gamma, args.repeats,
                          log=lambda line: print(line, flush=True), spread=args.context_spread)
    points = summarize(samples, args.gamma)
    report = {"target": args.target, "gamma": args.gamma, "context_spread": args.context_spread,
              "threads": args.threads, "repeats": args.repeats,
              "device": str(model.device), "torch_version": torch.__version__, "points": points}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "pass_cost.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(points, args.out_dir / "pass_cost.png",
         f"{pathlib.Path(args.target).name}: verify pass of γ + 1 = {args.gamma + 1} tokens per row, "
         + (f"cached lengths ± {args.context_spread // 2}, " if args.context_spread else "")
         + f"{args.threads} thread(s)")
    print(f"{'context':>8} {'rows':>5} {'pass ms':>8} {'per row':>8} {'gain':>6}")
    for p in points:
        gain = "" if p["batching_gain"] is None else f"{p['batching_gain']:.2f}"
        print(f"{p['context_tokens']:>8} {p['rows']:>5} {p['pass_ms']:>8.1f} {p['per_row_ms']:>8.2f} {gain:>6}")
    print(f"wrote {args.out_dir / 'pass_cost.json'} and {args.out_dir / 'pass_cost.png'}")
    return report


if __name__ == "__main__":
    main()
