"""Pipelined vs sequential rounds over gRPC (issue 6): tokens/s ratio, pre-draft hit rate, a round timeline.

    python -m benchmarks.overlap            # embedded pair, 8 held-out code prompts x 64 tokens, 5 runs
    python -m benchmarks.overlap --quick    # 2 prompts x 16 tokens, 3 runs, report to a temp folder

One LocalStack: a draft service (--threads 1) and a verify service (--threads 1), each its own process,
and two coordinators on those same replicas, one overlapped and one sequential (`--no-overlap`). Both
modes therefore use the same processes on the same cores. Batch 1, greedy. A run sends every prompt to
one coordinator, then to the other (the order alternates between runs); the ratio of a run is
overlapped tokens/s over sequential tokens/s, and the report gives the median over runs.

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

from benchmarks.stack_runs import (RequestRun, environment, prompt_texts, results_dir, timed_generate, totals,
                                   write_json)
from coordinator.__main__ import eos_token_ids
from coordinator.generation import Generation
from coordinator.replicas import ReplicaPool
from coordinator.settings import CoordinatorSettings
from coordinator.text_stream import TextStream
from coordinator.validation import plan_request
from specdec.client import Client, build_request
from specdec.embedded_pair import DEMO_DRAFT_DIR, DEMO_TARGET_DIR
from specdec.local_stack import LocalStack, start_service
from specdec.v1 import drafter_pb2_grpc, verifier_pb2_grpc

MODES = ("overlapped", "sequential")


def run_mode(client: Client, prompts: list[str], max_new_tokens: int, gamma: int) -> list[RequestRun]:
    return [timed_generate(client, prompt, max_new_tokens=max_new_tokens, temperature=0.0,
                           num_speculative_tokens=gamma) for prompt in prompts]


async def _timeline(draft_address: str, verify_address: str, tokenizer_dir: str, prompt: str, overlap: bool,
                    gamma: int, max_new_tokens: int) -> dict:
    """One request through the coordinator's Generation, in this process; its calls' (stage, start, end)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    settings = CoordinatorSettings(tokenizer=tokenizer_dir, overlap=overlap, draft_replicas=(draft_address,),
                                   verify_replicas=(verify_address,))
    draft_pool = ReplicaPool("draft", settings.draft_replicas, drafter_pb2_grpc.DrafterStub)
    verify_pool = ReplicaPool("verify", settings.verify_replicas, verifier_pb2_grpc.VerifierStub)
    try:
        await asyncio.gather(draft_pool.wait_ready(60), verify_pool.wait_ready(60))
        vocab_size = verify_pool.replicas[0].info.vocab_size
        for attempt in range(2):  # the first request warms both services; plot the second
            request = build_request(prompt, max_new_tokens=max_new_tokens, num_speculative_tokens=gamma,
                                    request_id=f"timeline-{uuid.uuid4().hex[:8]}")
            plan = plan_request(request, settings, tokenizer, vocab_size)
            text = TextStream(tokenizer, eos_token_ids(tokenizer_dir, tokenizer), [], plan.max_new_tokens)
            generation = Generation(plan, draft_pool.acquire(), verify_pool.acquire(), text, settings.call_timeout_s)
            async for _ in generation.chunks():
                pass
        stats = generation.stats
        return {"overlap": overlap, "tokens": len(text.token_ids), "total_ms": stats.total_ns / 1e6,
                "rounds": stats.rounds, "predraft_attempts": stats.predraft_attempts,
                "predraft_hits": stats.predraft_hits,
                "events": [(stage, start / 1e6, end / 1e6) for stage, start, end in stats.round_timeline]}
    finally:
        await asyncio.gather(draft_pool.close(), verify_pool.close())


def plot_timeline(timelines: dict[str, dict], path: pathlib.Path) -> None:
    """Two panels (overlapped, sequential), each with a draft lane and a verify lane, on one time axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colors = {"verify": "#d62728", "draft": "#1f77b4", "predraft": "#7fb8e6"}
    figure, axes = plt.subplots(len(timelines), 1, figsize=(12, 1.9 * len(timelines) + 0.8), sharex=True,
                                squeeze=False)
    for axis, (mode, timeline) in zip(axes[:, 0], timelines.items()):
        verifies = [(s, e) for stage, s, e in timeline["events"] if stage == "verify"]
        lanes = {"draft": [], "predraft": [], "verify": verifies}
        for stage, start, end in timeline["events"]:
            if stage == "draft":  # a Propose that starts while a Verify is in flight is a pre-draft
                overlapped = any(vs <= start < ve for vs, ve in verifies)
                lanes["predraft" if overlapped else "draft"].append((start, end))
        for kind, row in (("draft", 1), ("predraft", 1), ("verify", 0)):
            axis.broken_barh([(s, e - s) for s, e in lanes[kind]], (row - 0.35, 0.7), facecolors=colors[kind],
                             edgecolors="black", linewidth=0.4)
        axis.set_yticks([0, 1], ["verify service", "draft service"])
        axis.set_ylim(-0.6, 1.6)
        axis.grid(axis="x", alpha=0.3)
        axis.set_title(f"{mode}: {timeline['tokens']} tokens in {timeline['total_ms']:.0f} ms "
                       f"({timeline['rounds']} rounds, pre-draft hits {timeline['predraft_hits']}/"
                       f"{timeline['predraft_attempts']})", fontsize=10, loc="left")
    axes[-1, 0].set_xlabel("time since the request started (ms), as the coordinator saw each call")
    figure.legend(handles=[Patch(color=colors["draft"], label="Propose (block k)"),
                           Patch(color=colors["predraft"], label="Propose during Verify (pre-draft of block k+1)"),
                           Patch(color=colors["verify"], label="Verify (block k)")],
                  loc="upper right", ncol=3, fontsize=8, frameon=False)
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
    parser.add_argument("--timeline-tokens", type=int, default=48, help="max_new_tokens of the plotted request")
    parser.add_argument("--quick", action="store_true", help="2 prompts x 16 tokens, 3 runs, to a temp folder")
    parser.add_argument("--out-dir", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.max_new_tokens, args.runs, args.timeline_tokens = 2, 16, 3, 16
    out_dir = results_dir(args.out_dir, args.quick)
    prompts = prompt_texts(args.prompt_set, args.prompts)
    service_args = ["--threads", str(args.threads)]

    fixed_gamma = ["--no-adaptive-gamma"]  # both modes draft the same γ every round
    with LocalStack(args.target, args.draft, draft_args=service_args, verify_args=service_args,
                    coordinator_args=fixed_gamma) as stack:
        sequential = start_service("coordinator-sequential", "coordinator", [
            "--tokenizer", args.target, "--draft-replicas", stack.services["draft"].address,
            "--verify-replicas", stack.services["verify"].address, "--no-overlap", *fixed_gamma], stack.log_dir)
        try:
            with Client(stack.address) as overlapped_client, Client(sequential.address) as sequential_client:
                clients = {"overlapped": overlapped_client, "sequential": sequential_client}
                for client in clients.values():  # warm-up: first requests pay allocator and thread start-up
                    run_mode(client, prompts[:1], args.max_new_tokens, args.gamma)
                runs: list[dict[str, list[RequestRun]]] = []
                for index in range(args.runs):
                    order = MODES if index % 2 == 0 else MODES[::-1]
                    run = {mode: run_mode(clients[mode], prompts, args.max_new_tokens, args.gamma) for mode in order}
                    runs.append(run)
                    figures = {mode: totals(run[mode]) for mode in MODES}
                    print(f"run {index + 1}/{args.runs}: overlapped {figures['overlapped']['tokens_per_s']:.1f} tok/s, "
                          f"sequential {figures['sequential']['tokens_per_s']:.1f} tok/s, hit rate "
                          f"{figures['overlapped']['predraft_hit_rate']}", flush=True)
            timelines = {}
            for mode in MODES:
                timelines[mode] = asyncio.run(_timeline(stack.services["draft"].address,
                                                        stack.services["verify"].address, args.target, prompts[0],
                                                        mode == "overlapped", args.gamma, args.timeline_tokens))
        finally:
            sequential.stop()

    per_run = [{mode: totals(run[mode]) for mode in MODES} for run in runs]
    ratios = [r["overlapped"]["tokens_per_s"] / r["sequential"]["tokens_per_s"] for r in per_run]
    overall = {mode: totals([req for run in runs for req in run[mode]]) for mode in MODES}
    request_hit_rates = [req.hit_rate for run in runs for req in run["overlapped"] if req.hit_rate is not None]
    identical = all(a.token_ids == b.token_ids for run in runs
                    for a, b in zip(run["overlapped"], run["sequential"]))
    draft_ms, verify_ms = overall["sequential"]["draft_ms_per_round"], overall["sequential"]["verify_ms_per_round"]
    report = {
        "benchmark": "overlap",
        "what": "overlapped vs sequential rounds over gRPC, batch 1, greedy, same draft and verify processes",
        "target": args.target, "draft": args.draft, "prompt_set": args.prompt_set, "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens, "gamma": args.gamma, "runs": args.runs,
        "service_threads": {"draft": args.threads, "verify": args.threads},
        "tokens_per_s_ratio_median": round(statistics.median(ratios), 4),
        "tokens_per_s_ratio_per_run": [round(r, 4) for r in ratios],
        "tokens_per_s_median": {mode: round(statistics.median(r[mode]["tokens_per_s"] for r in per_run), 3)
                                for mode in MODES},
        "predraft_hit_rate": overall["overlapped"]["predraft_hit_rate"],
        "predraft_hit_rate_per_request": {
            "median": round(statistics.median(request_hit_rates), 4) if request_hit_rates else None,
            "min": round(min(request_hit_rates), 4) if request_hit_rates else None,
            "max": round(max(request_hit_rates), 4) if request_hit_rates else None},
        "outputs_identical": identical,
        # A round costs draft + verify sequentially; at best max(draft, verify) overlapped (every guess a hit).
        "ideal_ratio_from_call_times": (round((draft_ms + verify_ms) / max(draft_ms, verify_ms), 3)
                                        if draft_ms and verify_ms else None),
        "modes": overall,
        "per_run": per_run,
        "timeline": {mode: {k: v for k, v in t.items() if k != "events"} for mode, t in timelines.items()},
        "environment": environment(),
    }
    write_json(out_dir / "overlap.json", report)
    plot_timeline(timelines, out_dir / "overlap_timeline.png")
    print(f"overlapped / sequential tokens/s: median {report['tokens_per_s_ratio_median']:.3f}x over {args.runs} runs "
          f"(per run {', '.join(f'{r:.3f}' for r in ratios)}); pre-draft hit rate {report['predraft_hit_rate']}; "
          f"outputs identical: {identical}")
    return report


if __name__ == "__main__":
    main()
