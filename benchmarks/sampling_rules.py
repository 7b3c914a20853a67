"""The rejection rule vs the coupled rule for sampled requests, side by side over gRPC.

    python -m benchmarks.sampling_rules            # embedded pair, T 0.7 and 1.0, batch 1 and concurrency 16
    python -m benchmarks.sampling_rules --quick    # 2 prompts x 16 tokens, concurrency 4, to a temp folder
    python -m benchmarks.sampling_rules --pair smollm2 --out-dir DIR   # SmolLM2 (49,152 ids), chat prompts

One LocalStack (draft and verify service, one thread each) and one coordinator per mode on those same replicas,
all as deployed (overlapped, chained, adaptive γ and the gate on: the policy drafts as many pre-draft guesses as
the measured pass costs say fit inside a verification, and may choose plain rounds under load), requests asking
for γ 4 (--fixed-gamma: always γ 4 and every guess):

- `rejection`: --unseeded-sampling-rule rejection, the rule of unseeded requests before the coupled rule existed:
  accept x with probability min(1, p(x)/q(x)); the draft sends q; pre-drafts guess only "all accepted";
- `coupled_no_guesses`: --unseeded-sampling-rule coupled --predraft-guesses 0: Gumbel-max coupling, no q on the
  wire, pre-drafts still only "all accepted" (the hit rate before rejection guesses were enabled for it);
- `coupled`: --unseeded-sampling-rule coupled: also the draft's runners-up of log q + g as rejection guesses, one
  lane each (the default --predraft-guesses).

Requests carry no seed (a seed always selects the coupled rule), so each mode's coordinator picks its rule. For
each temperature (0.7, 1.0) and each concurrency (1: the prompts one after another; N: N requests at once, each
client thread sending its share back to back) every mode runs the same prompts, the modes in a rotating order.
Per measurement: α (accepted / drafted), tokens/s (generated tokens over the wall time of the measurement), the
pre-draft hit rate (hits / pre-drafted rounds) and wire bytes per round (serialized request + reply of the rounds'
ProposeLanes, Verify and VerifyNext calls, from GenerationStats.wire_bytes). Writes `sampling_rules.json` to
benchmarks/results/ (or --out-dir).
"""

from __future__ import annotations

import argparse
import pathlib
import time
from concurrent.futures import ThreadPoolExecutor

from transformers import AutoTokenizer

from benchmarks.pairs import PAIR_NAMES, chat_prompt_texts, model_pair
from benchmarks.stack_runs import RequestRun, environment, prompt_texts, results_dir, timed_generate, totals, write_json
from specdec.client import Client
from specdec.engine.embedded_pair import DEMO_DRAFT_DIR, DEMO_TARGET_DIR
from specdec.engine.gguf_checkpoint import resolve_model
from specdec.local_stack import LocalStack

MODES = {  # mode -> its coordinator's extra flags
    "rejection": ["--unseeded-sampling-rule", "rejection"],
    "coupled_no_guesses": ["--unseeded-sampling-rule", "coupled", "--predraft-guesses", "0"],
    "coupled": ["--unseeded-sampling-rule", "coupled"],
}
TEMPERATURES = (0.7, 1.0)
HEADLINE = (
    "acceptance_rate",
    "tokens_per_s",
    "predraft_hit_rate",
    "wire_bytes_per_round",
    "guesses_per_predraft",
    "drafted_per_round",
)


def measure(
    client: Client, prompts: list[str], concurrency: int, max_new_tokens: int, gamma: int, temperature: float
) -> dict:
    """Every prompt once through one coordinator at the given concurrency; the totals over the measurement's wall
    time (at concurrency 1 that is the sum of the requests' times)."""

    def one(prompt: str) -> RequestRun:
        return timed_generate(
            client, prompt, max_new_tokens=max_new_tokens, temperature=temperature, num_speculative_tokens=gamma
        )

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        runs = list(pool.map(one, prompts))
    wall_s = time.perf_counter() - started
    figures = totals(runs)
    figures["wall_s"] = round(wall_s, 3)
    figures["tokens_per_s"] = round(figures["tokens"] / wall_s, 3)
    return figures


def start_coordinators(stack: LocalStack, gamma: int, adaptive: bool) -> dict[str, object]:
    """One coordinator per mode on the stack's replicas."""
    common = [
        "--overlap",
        "--adaptive-gamma" if adaptive else "--no-adaptive-gamma",
        "--default-num-speculative-tokens",
        str(gamma),
    ]
    return {mode: stack.start_coordinator(f"coordinator-{mode}", *common, *flags) for mode, flags in MODES.items()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", choices=PAIR_NAMES, help="a pair and its prompts (overrides the three below)")
    parser.add_argument("--target", default=str(DEMO_TARGET_DIR))
    parser.add_argument("--draft", default=str(DEMO_DRAFT_DIR))
    parser.add_argument(
        "--prompt-set", default="code", help="load_tests prompt set (words: the tiny test models), or chat"
    )
    parser.add_argument("--prompts", type=int, default=8, help="prompts of a batch-1 measurement")
    parser.add_argument("--concurrency", type=int, default=16, help="requests at once in the concurrent measurement")
    parser.add_argument(
        "--concurrent-requests", type=int, default=32, help="requests of a concurrent measurement (its prompts)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument(
        "--fixed-gamma", action="store_true", help="coordinators with --no-adaptive-gamma: always γ and every guess"
    )
    parser.add_argument("--threads", type=int, default=1, help="--threads of the draft and of the verify service")
    parser.add_argument("--quick", action="store_true", help="2 prompts x 16 tokens, concurrency 4, to a temp folder")
    parser.add_argument("--out-dir", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.max_new_tokens, args.concurrency, args.concurrent_requests = 2, 16, 4, 4
    out_dir = results_dir(args.out_dir, args.quick)
    if args.pair:
        pair = model_pair(args.pair)
        args.target, args.draft, args.prompt_set = pair.target, pair.draft, pair.prompt_set
    count = max(args.prompts, args.concurrent_requests)
    if args.prompt_set == "chat":
        prompts = chat_prompt_texts(AutoTokenizer.from_pretrained(resolve_model(args.target)), count)
    else:
        prompts = prompt_texts(args.prompt_set, count)
    levels = {
        "c1": (1, prompts[: args.prompts]),
        f"c{args.concurrency}": (args.concurrency, prompts[: args.concurrent_requests]),
    }
    service_args = ["--threads", str(args.threads)]
    started = time.perf_counter()

    results: dict[str, dict[str, dict[str, dict]]] = {}  # temperature -> level -> mode -> figures
    with LocalStack(args.target, args.draft, draft_args=service_args, verify_args=service_args) as stack:
        coordinators = start_coordinators(stack, args.gamma, adaptive=not args.fixed_gamma)
        clients = {mode: Client(service.address, timeout_s=600) for mode, service in coordinators.items()}
        try:
            for client in clients.values():  # warm-up, unmeasured
                measure(client, prompts[:1], 1, 8, args.gamma, 1.0)
            rotation = 0
            for temperature in TEMPERATURES:
                label = f"T{temperature}"
                results[label] = {}
                for level, (concurrency, level_prompts) in levels.items():
                    results[label][level] = {}
                    modes = list(MODES)
                    order = modes[rotation % len(modes) :] + modes[: rotation % len(modes)]
                    rotation += 1
                    for mode in order:
                        figures = measure(
                            clients[mode], level_prompts, concurrency, args.max_new_tokens, args.gamma, temperature
                        )
                        results[label][level][mode] = figures
                        print(
                            f"  {label} {level} {mode:>18}: α {figures['acceptance_rate']}, "
                            f"{figures['tokens_per_s']:.1f} tok/s, hit rate {figures['predraft_hit_rate']}, "
                            f"{figures['guesses_per_predraft']} guesses/pre-draft, "
                            f"{figures['drafted_per_round']} drafted/round, "
                            f"{figures['wire_bytes_per_round']} B/round ({time.perf_counter() - started:.0f}s)",
                            flush=True,
                        )
        finally:
            for client in clients.values():
                client.close()
            for service in coordinators.values():
                service.stop()

    report = {
        "benchmark": "sampling_rules",
        "what": "the rejection rule vs the coupled rule (Gumbel-max coupling) for unseeded sampled requests, "
        "overlapped, γ 4 asked, at batch 1 and at concurrency N: α, tokens/s, pre-draft hit rate, wire bytes per round",
        "target": args.target,
        "draft": args.draft,
        "prompt_set": args.prompt_set,
        "max_new_tokens": args.max_new_tokens,
        "gamma": args.gamma,
        "adaptive_gamma": not args.fixed_gamma,
        "modes": {mode: " ".join(flags) for mode, flags in MODES.items()},
        "levels": {level: {"concurrency": c, "requests": len(p)} for level, (c, p) in levels.items()},
        "service_threads": {"draft": args.threads, "verify": args.threads},
        "headline": {
            label: {
                level: {mode: {key: figures[key] for key in HEADLINE} for mode, figures in by_mode.items()}
                for level, by_mode in by_level.items()
            }
            for label, by_level in results.items()
        },
        "results": results,
        "environment": environment(wall_s=round(time.perf_counter() - started, 1)),
    }
    write_json(out_dir / "sampling_rules.json", report)
    return report


if __name__ == "__main__":
    main()
