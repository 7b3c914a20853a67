"""Model-free n-gram drafting vs the draft model vs target-only, over gRPC.

    python -m benchmarks.ngram            # embedded pair, 12 prompts per set x 96 tokens
    python -m benchmarks.ngram --quick    # 2 prompts per set x 24 tokens, report to a temp folder

One LocalStack whose draft service holds the draft model and also serves n-gram prompt lookup; each
request picks its draft method. Three modes per prompt, through the same coordinator and processes:
plain (num_speculative_tokens = 0: one target step per token through the verifier), n-gram (draft_method
NGRAM) and model (draft_method MODEL). The modes run back to back on each prompt, their order rotating
from prompt to prompt. Two prompt sets: input-grounded prompts (quote a held-out function, ask for it
back) and free generation (windows of held-out code). Greedy by default. Speedup = a mode's tokens/s
over plain tokens/s on the same prompts. Writes `ngram.json` to benchmarks/results/ (or --out-dir).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics

from benchmarks.stack_runs import RequestRun, environment, prompt_texts, results_dir, timed_generate, totals, write_json
from specdec.client import Client
from specdec.engine.embedded_pair import DEMO_DRAFT_DIR, DEMO_TARGET_DIR
from specdec.local_stack import LocalStack
from specdec.v1 import common_pb2

MODES = ("plain", "ngram", "model")
DRAFT_METHODS = {
    "plain": common_pb2.DRAFT_METHOD_UNSPECIFIED,
    "ngram": common_pb2.DRAFT_METHOD_NGRAM,
    "model": common_pb2.DRAFT_METHOD_MODEL,
}
SET_LABELS = {"grounded": "input-grounded", "code": "free generation", "words": "tiny-model words"}


def run_set(
    client: Client, prompts: list[str], gammas: dict[str, int], max_new_tokens: int, temperature: float
) -> dict[str, list[RequestRun]]:
    """Every prompt in every mode, modes back to back per prompt in a rotating order."""

    def one(mode: str, index: int, prompt: str) -> RequestRun:
        return timed_generate(
            client,
            prompt,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=index,
            num_speculative_tokens=gammas[mode],
            draft_method=DRAFT_METHODS[mode],
        )

    for mode in MODES:  # warm-up, unmeasured
        one(mode, 0, prompts[0])
    runs: dict[str, list[RequestRun]] = {mode: [] for mode in MODES}
    for index, prompt in enumerate(prompts):
        order = MODES[index % len(MODES) :] + MODES[: index % len(MODES)]
        for mode in order:
            runs[mode].append(one(mode, index, prompt))
        print(
            f"  prompt {index + 1}/{len(prompts)}: "
            + ", ".join(f"{mode} {len(runs[mode][-1].token_ids) / runs[mode][-1].seconds:.1f} tok/s" for mode in MODES),
            flush=True,
        )
    return runs


def summarize_set(runs: dict[str, list[RequestRun]], greedy: bool) -> dict:
    figures = {mode: totals(runs[mode]) for mode in MODES}
    plain_rate = figures["plain"]["tokens_per_s"]
    summary = {}
    for mode in ("ngram", "model"):
        per_prompt = [
            (len(s.token_ids) / s.seconds) / (len(p.token_ids) / p.seconds) for s, p in zip(runs[mode], runs["plain"])
        ]
        summary[mode] = {
            "acceptance_rate": figures[mode]["acceptance_rate"],
            "speedup_vs_target_only": round(figures[mode]["tokens_per_s"] / plain_rate, 4),
            "speedup_per_prompt_median": round(statistics.median(per_prompt), 4),
            "mean_accepted_length": figures[mode]["mean_accepted_length"],
            "drafted_per_round": figures[mode]["drafted_per_round"],
            "tokens_per_s": figures[mode]["tokens_per_s"],
        }
        if greedy:
            summary[mode]["outputs_identical_to_plain"] = all(
                s.token_ids == p.token_ids for s, p in zip(runs[mode], runs["plain"])
            )
    summary["plain"] = {"tokens_per_s": plain_rate}
    summary["modes"] = figures
    return summary


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(DEMO_TARGET_DIR))
    parser.add_argument("--draft", default=str(DEMO_DRAFT_DIR))
    parser.add_argument(
        "--prompt-sets",
        default="grounded,code",
        help="comma-separated load_tests prompt sets (words: the tiny test models)",
    )
    parser.add_argument("--prompts", type=int, default=12, help="prompts per set")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--gamma", type=int, default=4, help="num_speculative_tokens of the model drafter")
    parser.add_argument("--ngram-gamma", type=int, default=4, help="num_speculative_tokens of the n-gram drafter")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=1, help="--threads of the draft and of the verify service")
    parser.add_argument("--no-overlap", action="store_true", help="run the coordinator in sequential mode")
    parser.add_argument("--quick", action="store_true", help="2 prompts per set x 24 tokens, to a temp folder")
    parser.add_argument("--out-dir", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.max_new_tokens = 2, 24
    out_dir = results_dir(args.out_dir, args.quick)
    gammas = {"plain": 0, "ngram": args.ngram_gamma, "model": args.gamma}
    service_args = ["--threads", str(args.threads)]
    coordinator_args = ["--no-overlap" if args.no_overlap else "--overlap", "--no-adaptive-gamma"]  # the γ asked for

    sets = {}
    with (
        LocalStack(
            args.target,
            args.draft,
            draft_args=service_args,
            verify_args=service_args,
            coordinator_args=coordinator_args,
        ) as stack,
        Client(stack.address) as client,
    ):
        for set_name in args.prompt_sets.split(","):
            print(f"{set_name} ({SET_LABELS.get(set_name, set_name)}):", flush=True)
            runs = run_set(client, prompt_texts(set_name, args.prompts), gammas, args.max_new_tokens, args.temperature)
            sets[set_name] = {
                "label": SET_LABELS.get(set_name, set_name),
                "prompts": args.prompts,
                **summarize_set(runs, args.temperature == 0),
            }

    report = {
        "benchmark": "ngram",
        "what": "α and speedup vs target-only (num_speculative_tokens=0 through the same stack) of the n-gram "
        "and the model drafter, per prompt set, batch 1",
        "target": args.target,
        "draft": args.draft,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "gamma": {"model": args.gamma, "ngram": args.ngram_gamma},
        "overlap": not args.no_overlap,
        "service_threads": {"draft": args.threads, "verify": args.threads},
        "ngram_settings": "draft service defaults (--ngram-min, --ngram-max, --ngram-max-proposal)",
        "sets": sets,
        "environment": environment(),
    }
    write_json(out_dir / "ngram.json", report)
    for figures in sets.values():
        print(
            f"{figures['label']:>16}: "
            + "; ".join(
                f"{mode} α={figures[mode]['acceptance_rate']} speedup {figures[mode]['speedup_vs_target_only']:.2f}x"
                for mode in ("ngram", "model")
            )
            + f" (plain {figures['plain']['tokens_per_s']:.1f} tok/s)"
        )
    return report


if __name__ == "__main__":
    main()
