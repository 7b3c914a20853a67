"""What one batched verify pass costs against its rows and their cached context: the bound on how much cheaper
per session continuous batching makes the target's work, and so on what batching can gain over one session
per pass.

For each cached context length L and row count R, R sessions holding L tokens each (or, with --context-spread S,
lengths spaced evenly over L ± S/2 in random slot order, as sessions at different points of their requests hold;
the one-row passes hold the length nearest L) score a block of γ drafted tokens (γ + 1 tokens fed per row) in
one packed pass, the forward the verify service runs for a step (`specdec.engine.kv.session.run_forwards`); the block
is then rolled back, so every sample sees the same lengths. The (L, R) points are timed round-robin, `--repeats`
rounds, so drift hits them alike. The report gives per point the median pass time and the batching gain
R × pass(L, 1 row) / pass(L, R rows): how many times less target time a session's round costs in a pass of R
than alone. It leaves out what both ways pay alike (prefills, wire, drafting), so a stack's on/off throughput
ratio stays below it.

With --prompt-tokens P, a prefill of a P-token prompt is timed in the same round-robin, and each point also gets
the on/off ceiling of a workload of such prompts and --new-tokens N, committed --tokens-per-round t at a time:

    (prefill + N/t × pass(L, 1 row)) / (prefill + N/t × pass(L, R rows) / R)

the target time one request costs with batching off over what it costs in passes of R, both ways paying the
prefill in full. It is what a stack with batching on could reach over one with it off if the verifier's passes
were its only cost and every pass held R rows: no waits, no drafter on the same cores, no ramp or drain.

    python -m benchmarks.pass_cost                                 # demo target, ~2 min
    python -m benchmarks.pass_cost --contexts 60,240 --rows 1,16 --repeats 5 --out-dir /tmp/pass_cost
    python -m benchmarks.pass_cost --contexts 240 --context-spread 300 --out-dir /tmp/pass_cost_spread
    python -m benchmarks.pass_cost --contexts 190 --context-spread 250 --rows 1,8,16 --prompt-tokens 126
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specdec.engine.attention.selection import AttentionBackendChoice
from specdec.engine.embedded_pair import DEMO_TARGET_DIR
from specdec.engine.kv.session import KVSession, run_forwards
from specdec.engine.model_runtime import LoadedModel, ModelSettings

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"


def _csv_ints(raw: str) -> tuple[int, ...]:
    return tuple(int(part) for part in raw.split(",") if part.strip())


def context_lengths(context: int, spread: int, count: int, rng: random.Random) -> list[int]:
    """count cached lengths spaced evenly over context ± spread / 2 (all `context` when spread is 0): first the one
    nearest the context, which the one-row passes hold, then the others in random order."""
    if count == 1:
        return [context]
    lengths = sorted(
        (round(context - spread / 2 + i * spread / (count - 1)) for i in range(count)),
        key=lambda length: abs(length - context),
    )
    rest = lengths[1:]
    rng.shuffle(rest)
    return lengths[:1] + rest


@dataclass(frozen=True)
class Timings:
    """Milliseconds of every timed pass per (context, rows), and of every timed prefill (none without one)."""

    passes: dict[tuple[int, int], list[float]]
    prefill_ms: list[float]


@dataclass(frozen=True)
class Workload:
    """Requests the on/off ceiling is worked out for: their prefill's median cost and what they generate."""

    prompt_tokens: int
    prefill_ms: float
    new_tokens: int
    tokens_per_round: float

    @property
    def rounds(self) -> float:
        """Verify passes one request takes part in."""
        return self.new_tokens / self.tokens_per_round


def time_passes(
    model: LoadedModel,
    contexts: Sequence[int],
    rows: Sequence[int],
    gamma: int,
    repeats: int,
    log: Callable[[str], None] = print,
    spread: int = 0,
    prompt_tokens: int = 0,
) -> Timings:
    """`repeats` samples of each (context, rows) pass, and of a prefill of prompt_tokens (0: none), after one
    unrecorded round."""
    rng = random.Random(0)
    sessions: dict[int, list[KVSession]] = {}
    for context in contexts:  # max(rows) sessions per context, prefilled one by one
        sessions[context] = [
            KVSession(model, [rng.randrange(1, model.vocab_size) for _ in range(length)])
            for length in context_lengths(context, spread, max(rows), rng)
        ]
        for session in sessions[context]:
            session.prefill()
            session.next_logits = None  # a round in steady state feeds its last committed token too: γ + 1 tokens
    timings = Timings({(context, count): [] for context in contexts for count in rows}, [])
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
                    timings.passes[context, count].append(elapsed_ms)
        if prompt_tokens:  # a new request's prompt, as the verify service prefills it on open
            prompt = KVSession(model, [rng.randrange(1, model.vocab_size) for _ in range(prompt_tokens)])
            started = time.perf_counter_ns()
            prompt.prefill()
            elapsed_ms = (time.perf_counter_ns() - started) / 1e6
            del prompt  # frees its cache slot
            if repeat:
                timings.prefill_ms.append(elapsed_ms)
        log(f"round {repeat}/{repeats}" + (" (warm-up, not recorded)" if not repeat else ""))
    return timings


def on_off_ceiling(workload: Workload, alone_ms: float, pass_ms: float, rows: int) -> float:
    """Target time of one request with batching off over with it on, in passes of `rows` that cost pass_ms
    (alone_ms with one row), both ways paying the prefill in full."""
    return (workload.prefill_ms + workload.rounds * alone_ms) / (workload.prefill_ms + workload.rounds * pass_ms / rows)


def summarize(samples: dict[tuple[int, int], list[float]], gamma: int, workload: Workload | None = None) -> list[dict]:
    """Per (context, rows): the median pass in ms, per row, the batching gain against one row alone and, given a
    workload, the on/off ceiling."""
    medians = {point: statistics.median(times) for point, times in samples.items()}
    points = []
    for (context, count), median_ms in sorted(medians.items()):
        alone_ms = medians.get((context, 1))
        point = {
            "context_tokens": context,
            "rows": count,
            "tokens_fed": count * (gamma + 1),
            "pass_ms": round(median_ms, 2),
            "per_row_ms": round(median_ms / count, 2),
            "batching_gain": round(count * alone_ms / median_ms, 2) if alone_ms else None,
        }
        if workload is not None:
            point["on_off_ceiling"] = (
                round(on_off_ceiling(workload, alone_ms, median_ms, count), 2) if alone_ms else None
            )
        points.append(point | {"samples_ms": [round(t, 2) for t in samples[context, count]]})
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
            drawn = gains.plot(
                [p["rows"] for p in line], [p["batching_gain"] for p in line], marker="o", label=f"{context} cached"
            )
            if all(p.get("on_off_ceiling") is not None for p in line):
                gains.plot(
                    [p["rows"] for p in line],
                    [p["on_off_ceiling"] for p in line],
                    marker="s",
                    linestyle="--",
                    color=drawn[0].get_color(),
                    label=f"{context} cached, on/off ceiling",
                )
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
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.pass_cost", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default=str(DEMO_TARGET_DIR), help="target model directory")
    parser.add_argument(
        "--contexts",
        type=_csv_ints,
        default=(60, 120, 240, 360),
        help="cached tokens per session, comma-separated [60,120,240,360]",
    )
    parser.add_argument(
        "--rows",
        type=_csv_ints,
        default=(1, 2, 4, 8, 16),
        help="sessions per pass, comma-separated; 1 is the reference of the gain [1,2,4,8,16]",
    )
    parser.add_argument(
        "--context-spread",
        type=int,
        default=0,
        help="sessions' cached lengths spread evenly over each context ± this / 2 [0]",
    )
    parser.add_argument("--gamma", type=int, default=4, help="drafted tokens per row (γ + 1 fed) [4]")
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds over every point [15]")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the verify service's --threads) [1]")
    parser.add_argument(
        "--attention-backend",
        type=AttentionBackendChoice,
        default=AttentionBackendChoice.AUTO,
        choices=list(AttentionBackendChoice),
        metavar="{" + ",".join(choice.value for choice in AttentionBackendChoice) + "}",
        help="how packed passes attend, as the services' --attention-backend (sdpa: without the CPU kernel) [auto]",
    )
    workload = parser.add_argument_group("on/off ceiling of a workload (with --prompt-tokens)")
    workload.add_argument(
        "--prompt-tokens",
        type=int,
        default=0,
        help="prompt length whose prefill is timed; 0 = no prefill, no ceiling [0]",
    )
    workload.add_argument("--new-tokens", type=int, default=128, help="tokens each request generates [128]")
    workload.add_argument(
        "--tokens-per-round",
        type=float,
        default=2.9,
        help="tokens a round commits (a load test's tok/rnd; the demo pair's unbatched stack "
        "makes 2.85-2.89 at γ 4) [2.9]",
    )
    parser.add_argument("--out-dir", type=pathlib.Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    if not args.contexts or not args.rows or min(args.rows) < 1 or args.gamma < 0 or args.context_spread < 0:
        parser.error("--rows must be >= 1, --gamma >= 0, --context-spread >= 0")
    if min(args.contexts) - args.context_spread / 2 < 2:
        parser.error("every context less half the spread must be >= 2 tokens")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.prompt_tokens < 0 or args.new_tokens < 1 or args.tokens_per_round <= 0:
        parser.error("--prompt-tokens must be >= 0, --new-tokens >= 1, --tokens-per-round > 0")
    print(f"loading {args.target} ...", flush=True)
    model = LoadedModel.load(ModelSettings(args.target, threads=args.threads, attention_backend=args.attention_backend))
    timings = time_passes(
        model,
        args.contexts,
        args.rows,
        args.gamma,
        args.repeats,
        log=lambda line: print(line, flush=True),
        spread=args.context_spread,
        prompt_tokens=args.prompt_tokens,
    )
    workload = (
        Workload(args.prompt_tokens, statistics.median(timings.prefill_ms), args.new_tokens, args.tokens_per_round)
        if args.prompt_tokens
        else None
    )
    points = summarize(timings.passes, args.gamma, workload)
    report = {
        "target": args.target,
        "gamma": args.gamma,
        "context_spread": args.context_spread,
        "threads": args.threads,
        "repeats": args.repeats,
        "attention_backend": model.attention_backend.name,
        "device": str(model.device),
        "torch_version": torch.__version__,
        "points": points,
    }
    if workload is not None:
        report["workload"] = {
            "prompt_tokens": workload.prompt_tokens,
            "prefill_ms": round(workload.prefill_ms, 2),
            "prefill_samples_ms": [round(t, 2) for t in timings.prefill_ms],
            "new_tokens": workload.new_tokens,
            "tokens_per_round": workload.tokens_per_round,
        }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "pass_cost.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(
        points,
        args.out_dir / "pass_cost.png",
        f"{pathlib.Path(args.target).name}: verify pass of γ + 1 = {args.gamma + 1} tokens per row, "
        + (f"cached lengths ± {args.context_spread // 2}, " if args.context_spread else "")
        + f"{args.threads} thread(s)"
        + (
            f"\nceiling: prefill of {workload.prompt_tokens} tokens {workload.prefill_ms:.0f} ms, "
            f"{workload.new_tokens} new tokens at {workload.tokens_per_round:g} a round"
            if workload
            else ""
        ),
    )
    if workload is not None:
        print(
            f"prefill of {workload.prompt_tokens} tokens: {workload.prefill_ms:.1f} ms; on/off ceiling for "
            f"{workload.new_tokens} new tokens at {workload.tokens_per_round:g} a round"
        )
    print(
        f"{'context':>8} {'rows':>5} {'pass ms':>8} {'per row':>8} {'gain':>6}"
        + (f" {'ceiling':>8}" if workload is not None else "")
    )
    for p in points:
        gain = "" if p["batching_gain"] is None else f"{p['batching_gain']:.2f}"
        ceiling = "" if p.get("on_off_ceiling") is None else f"{p['on_off_ceiling']:.2f}"
        print(
            f"{p['context_tokens']:>8} {p['rows']:>5} {p['pass_ms']:>8.1f} {p['per_row_ms']:>8.2f} {gain:>6}"
            + (f" {ceiling:>8}" if workload is not None else "")
        )
    print(f"wrote {args.out_dir / 'pass_cost.json'} and {args.out_dir / 'pass_cost.png'}")
    return report


if __name__ == "__main__":
    main()
