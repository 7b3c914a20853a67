"""Pipelined vs sequential rounds over gRPC: tokens/s ratio, pre-draft hit rate, a round timeline.

    python -m benchmarks.overlap            # embedded pair, 8 held-out code prompts x 64 tokens, 5 runs
    python -m benchmarks.overlap --quick    # 2 prompts x 16 tokens, 3 runs, report to a temp folder

One LocalStack: a draft service (--threads 1) and a verify service (--threads 1), each its own process,
and one coordinator per mode on those same replicas: sequential (`--no-overlap`) and one per pre-draft
policy (coordinator/verdict_guesses.py): "all_accepted" (`--predraft-guesses 0`: the single guess that the whole
block is accepted and the bonus token is the draft's own), and "guesses_N" (also N rejection guesses per block
position, each a position and one of the draft's next most likely tokens there, ranked by the request's verdicts
so far; guesses_2 is the default).
Every mode therefore uses the same processes on the same cores. Batch 1, greedy. A run sends each prompt
to every coordinator back to back (the order rotates per prompt); a run's ratio for a policy is its tokens/s
over sequential tokens/s, and the report gives the median over runs and names the policy that wins.

The timeline runs the coordinator's own `Generation` in this process against the same draft and verify
servers, once per mode, and plots each Propose and Verify call as the coordinator saw it (two lanes).
Writes `overlap.json` and `overlap_timeline.png` to benchmarks/results/ (or --out-dir).
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import statistics
import uuid

from benchmarks.stack_runs import (
    RequestRun,
    environment,
    pinned_cores,
    prompt_texts,
    results_dir,
    timed_generate,
    totals,
    write_json,
)
from coordinator.__main__ import eos_token_ids
from coordinator.generation import Generation
from coordinator.replicas import ReplicaPool
from coordinator.settings import CoordinatorSettings
from coordinator.text_stream import TextStream
from coordinator.validation import plan_request
from specdec.client import Client, build_request
from specdec.engine.cpu_affinity import pin_cpus
from specdec.engine.embedded_pair import DEMO_DRAFT_DIR, DEMO_TARGET_DIR
from specdec.local_stack import LocalStack
from specdec.v1 import drafter_pb2_grpc, verifier_pb2_grpc

POLICIES = {"all_accepted": 0, "guesses_1": 1, "guesses_2": 2, "guesses_3": 3}  # mode -> --predraft-guesses
DEFAULT_POLICY = "guesses_2"
MODES = ("sequential", *POLICIES)


def run_mode(client: Client, prompts: list[str], max_new_tokens: int, gamma: int) -> list[RequestRun]:
    return [
        timed_generate(client, prompt, max_new_tokens=max_new_tokens, temperature=0.0, num_speculative_tokens=gamma)
        for prompt in prompts
    ]


def run_interleaved(
    clients: dict[str, Client], prompts: list[str], max_new_tokens: int, gamma: int, rotation: int
) -> dict[str, list[RequestRun]]:
    """Every prompt through every mode back to back (the mode order rotates per prompt), so a slow spell of the
    machine falls on all modes alike."""
    runs: dict[str, list[RequestRun]] = {mode: [] for mode in clients}
    modes = list(clients)
    for index, prompt in enumerate(prompts):
        shift = (rotation + index) % len(modes)
        for mode in modes[shift:] + modes[:shift]:
            runs[mode].extend(run_mode(clients[mode], [prompt], max_new_tokens, gamma))
    return runs


async def _timeline(
    draft_address: str,
    verify_address: str,
    tokenizer_dir: str,
    prompt: str,
    overlap: bool,
    gamma: int,
    max_new_tokens: int,
) -> dict:
    """One request through the coordinator's Generation, in this process; its calls' (stage, start, end)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    settings = CoordinatorSettings(
        tokenizer=tokenizer_dir, overlap=overlap, draft_replicas=(draft_address,), verify_replicas=(verify_address,)
    )
    draft_pool = ReplicaPool("draft", settings.draft_replicas, drafter_pb2_grpc.DrafterStub)
    verify_pool = ReplicaPool("verify", settings.verify_replicas, verifier_pb2_grpc.VerifierStub)
    try:
        await asyncio.gather(draft_pool.wait_ready(60), verify_pool.wait_ready(60))
        vocab_size = verify_pool.replicas[0].info.vocab_size
        for _ in range(2):  # the first request warms both services; plot the second
            request = build_request(
                prompt,
                max_new_tokens=max_new_tokens,
                num_speculative_tokens=gamma,
                request_id=f"timeline-{uuid.uuid4().hex[:8]}",
            )
            plan = plan_request(request, settings, tokenizer, vocab_size)
            text = TextStream(tokenizer, eos_token_ids(tokenizer_dir, tokenizer), [], plan.max_new_tokens)
            generation = Generation(plan, draft_pool.acquire(), verify_pool.acquire(), text, settings.call_timeout_s)
            async for _ in generation.chunks():
                pass
        stats = generation.stats
        return {
            "overlap": overlap,
            "tokens": len(text.token_ids),
            "total_ms": stats.total_ns / 1e6,
            "rounds": stats.rounds,
            "predraft_attempts": stats.predraft_attempts,
            "predraft_hits": stats.predraft_hits,
            "events": [(stage, start / 1e6, end / 1e6) for stage, start, end in stats.round_timeline],
        }
    finally:
        await asyncio.gather(draft_pool.close(), verify_pool.close())


def plot_timeline(timelines: dict[str, dict], path: pathlib.Path) -> None:
    """Two panels (overlapped, sequential), each with a draft lane and a verify lane, on one time axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colors = {"verify": "#d62728", "draft": "#1f77b4", "predraft": "#7fb8e6"}
    figure, axes = plt.subplots(len(timelines), 1, figsize=(12, 1.9 * len(timelines) + 0.8), sharex=True, squeeze=False)
    for axis, (mode, timeline) in zip(axes[:, 0], timelines.items()):
        verifies = [(s, e) for stage, s, e in timeline["events"] if stage == "verify"]
        lanes = {"draft": [], "predraft": [], "verify": verifies}
        for stage, start, end in timeline["events"]:
            if stage == "draft":  # a Propose that starts while a Verify is in flight is a pre-draft
                overlapped = any(vs <= start < ve for vs, ve in verifies)
                lanes["predraft" if overlapped else "draft"].append((start, end))
        for kind, row in (("draft", 1), ("predraft", 1), ("verify", 0)):
            axis.broken_barh(
                [(s, e - s) for s, e in lanes[kind]],
                (row - 0.35, 0.7),
                facecolors=colors[kind],
                edgecolors="black",
                linewidth=0.4,
            )
        axis.set_yticks([0, 1], ["verify service", "draft service"])
        axis.set_ylim(-0.6, 1.6)
        axis.grid(axis="x", alpha=0.3)
        axis.set_title(
            f"{mode}: {timeline['tokens']} tokens in {timeline['total_ms']:.0f} ms "
            f"({timeline['rounds']} rounds, pre-draft hits {timeline['predraft_hits']}/"
            f"{timeline['predraft_attempts']})",
            fontsize=10,
            loc="left",
        )
    axes[-1, 0].set_xlabel("time since the request started (ms), as the coordinator saw each call")
    figure.legend(
        handles=[
            Patch(color=colors["draft"], label="Propose (block k)"),
            Patch(color=colors["predraft"], label="Propose during Verify (pre-draft of block k+1)"),
            Patch(color=colors["verify"], label="Verify (block k)"),
        ],
        loc="upper right",
        ncol=3,
        fontsize=8,
        frameon=False,
    )
    figure.suptitle("One request's rounds, greedy, batch 1", x=0.01, ha="left", fontsize=11)
    figure.tight_layout(rect=(0, 0, 1, 0.93))
    figure.savefig(path, dpi=120)
    plt.close(figure)
    print(f"wrote {path}", flush=True)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(DEMO_TARGET_DIR))
    parser.add_argument("--draft", default=str(DEMO_DRAFT_DIR))
    parser.add_argument("--prompt-set", default="code", help="load_tests prompt set (words: the tiny test models)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--runs", type=int, default=5, help="runs per mode (the report gives the median, >= 3)")
    parser.add_argument("--threads", type=int, default=1, help="--threads of the draft and of the verify service")
    parser.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="let the services share cores (default: the draft service and the verify service each "
        "on cores of their own, when the machine has enough; the coordinators, and this process, "
        "on the draft service's)",
    )
    parser.add_argument("--timeline-tokens", type=int, default=48, help="max_new_tokens of the plotted request")
    parser.add_argument("--quick", action="store_true", help="2 prompts x 16 tokens, 3 runs, to a temp folder")
    parser.add_argument("--out-dir", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.max_new_tokens, args.runs, args.timeline_tokens = 2, 16, 3, 16
    out_dir = results_dir(args.out_dir, args.quick)
    prompts = prompt_texts(args.prompt_set, args.prompts)
    service_args = ["--threads", str(args.threads)]
    pins = pinned_cores(args.threads) if args.pin else {}
    pin_flags = {name: ["--cpus", cores] for name, cores in pins.items()}

    fixed_gamma = ["--no-adaptive-gamma"]  # every mode drafts the same γ every round
    coordinator_args = {
        mode: [*extra, *fixed_gamma, *pin_flags.get("coordinator", [])]
        for mode, extra in {
            "sequential": ["--no-overlap"],
            **{mode: ["--predraft-guesses", str(guesses)] for mode, guesses in POLICIES.items()},
        }.items()
    }
    with LocalStack(
        args.target,
        args.draft,
        draft_args=[*service_args, *pin_flags.get("draft", [])],
        verify_args=[*service_args, *pin_flags.get("verify", [])],
        coordinator_args=coordinator_args[DEFAULT_POLICY],
    ) as stack:  # the stack's own serves the default
        coordinators = {
            mode: stack.start_coordinator(f"coordinator-{mode}", *flags)
            for mode, flags in coordinator_args.items()
            if mode != DEFAULT_POLICY
        }
        addresses = {DEFAULT_POLICY: stack.address, **{mode: c.address for mode, c in coordinators.items()}}
        if pins:
            pin_cpus(pins["coordinator"])  # the client and the timeline's in-process coordinator
        try:
            clients = {mode: Client(addresses[mode]) for mode in MODES}
            for client in clients.values():  # warm-up: first requests pay allocator and thread start-up
                run_mode(client, prompts[:1], args.max_new_tokens, args.gamma)
            runs: list[dict[str, list[RequestRun]]] = []
            for index in range(args.runs):
                run = run_interleaved(clients, prompts, args.max_new_tokens, args.gamma, rotation=index)
                runs.append(run)
                figures = {mode: totals(run[mode]) for mode in MODES}
                print(
                    f"run {index + 1}/{args.runs}: "
                    + ", ".join(
                        f"{mode} {figures[mode]['tokens_per_s']:.1f} tok/s"
                        + (f" (hit rate {figures[mode]['predraft_hit_rate']})" if mode in POLICIES else "")
                        for mode in MODES
                    ),
                    flush=True,
                )
            for client in clients.values():
                client.close()
            timelines = {}
            for mode, overlap in (("overlapped", True), ("sequential", False)):
                timelines[mode] = asyncio.run(
                    _timeline(
                        stack.services["draft"].address,
                        stack.services["verify"].address,
                        args.target,
                        prompts[0],
                        overlap,
                        args.gamma,
                        args.timeline_tokens,
                    )
                )
        finally:
            for coordinator in coordinators.values():
                coordinator.stop()

    per_run = [{mode: totals(run[mode]) for mode in MODES} for run in runs]
    overall = {mode: totals([req for run in runs for req in run[mode]]) for mode in MODES}
    policies = {}
    for mode in POLICIES:
        ratios = [r[mode]["tokens_per_s"] / r["sequential"]["tokens_per_s"] for r in per_run]
        hit_rates = [req.hit_rate for run in runs for req in run[mode] if req.hit_rate is not None]
        policies[mode] = {
            "predraft_guesses_setting": POLICIES[mode],
            "tokens_per_s_ratio_median": round(statistics.median(ratios), 4),
            "tokens_per_s_ratio_per_run": [round(r, 4) for r in ratios],
            "predraft_hit_rate": overall[mode]["predraft_hit_rate"],
            "guesses_per_predraft": overall[mode]["guesses_per_predraft"],
            "predraft_hit_rate_per_request": {
                "median": round(statistics.median(hit_rates), 4) if hit_rates else None,
                "min": round(min(hit_rates), 4) if hit_rates else None,
                "max": round(max(hit_rates), 4) if hit_rates else None,
            },
            "outputs_identical_to_sequential": all(
                a.token_ids == b.token_ids for run in runs for a, b in zip(run[mode], run["sequential"])
            ),
        }
    winner = max(policies, key=lambda mode: policies[mode]["tokens_per_s_ratio_median"])
    draft_ms, verify_ms = overall["sequential"]["draft_ms_per_round"], overall["sequential"]["verify_ms_per_round"]
    report = {
        "benchmark": "overlap",
        "what": "overlapped (per pre-draft policy) vs sequential rounds over gRPC, batch 1, greedy, same draft and "
        "verify processes",
        "target": args.target,
        "draft": args.draft,
        "prompt_set": args.prompt_set,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "gamma": args.gamma,
        "runs": args.runs,
        "service_threads": {"draft": args.threads, "verify": args.threads},
        "service_cpus": pins,
        "default_policy": DEFAULT_POLICY,
        "tokens_per_s_ratio_median": policies[DEFAULT_POLICY]["tokens_per_s_ratio_median"],
        "predraft_hit_rate": policies[DEFAULT_POLICY]["predraft_hit_rate"],
        "winning_policy": winner,
        "policies": policies,
        "tokens_per_s_median": {
            mode: round(statistics.median(r[mode]["tokens_per_s"] for r in per_run), 3) for mode in MODES
        },
        "outputs_identical": all(p["outputs_identical_to_sequential"] for p in policies.values()),
        # A round costs draft + verify sequentially; at best max(draft, verify) overlapped (every guess a hit).
        "ideal_ratio_from_call_times": (
            round((draft_ms + verify_ms) / max(draft_ms, verify_ms), 3) if draft_ms and verify_ms else None
        ),
        "modes": overall,
        "per_run": per_run,
        "timeline": {mode: {k: v for k, v in t.items() if k != "events"} for mode, t in timelines.items()},
        "environment": environment(),
    }
    write_json(out_dir / "overlap.json", report)
    plot_timeline(timelines, out_dir / "overlap_timeline.png")
    for mode, figures in policies.items():
        print(
            f"{mode}: overlapped / sequential tokens/s median {figures['tokens_per_s_ratio_median']:.3f}x over "
            f"{args.runs} runs (per run {', '.join(f'{r:.3f}' for r in figures['tokens_per_s_ratio_per_run'])}); "
            f"hit rate {figures['predraft_hit_rate']}, {figures['guesses_per_predraft']} guesses per pre-draft"
        )
    print(f"winning policy: {winner}; outputs identical to sequential: {report['outputs_identical']}")
    return report


if __name__ == "__main__":
    main()
