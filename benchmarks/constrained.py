"""Constrained speculative decoding vs unconstrained speculative decoding vs constrained plain decoding, over gRPC.

    python -m benchmarks.constrained            # embedded pair, 8 prompts x 3 runs, 96 new tokens at most
    python -m benchmarks.constrained --quick    # 2 prompts x 1 run x 24 tokens, report to a temp folder
    python -m benchmarks.constrained --pair smollm2 --gamma 2 --out-dir benchmarks/results/smollm2

One LocalStack (the draft service and the coordinator on one core, the verify service on another, as
benchmarks/stack_runs.pinned_cores pins them), γ fixed (--no-adaptive-gamma), greedy. Per constraint three modes on
each prompt, back to back in a rotating order: `constrained` (γ > 0 with the constraint), `unconstrained` (the same
γ, no constraint) and `constrained_plain` (γ 0 with the constraint: one masked target step per token through the
verifier). Three constraints: a JSON schema, every mode's code prompt followed by "\nCONFIG = " (a prompt that asks
for a literal, as a user asks for JSON; the code-trained demo pair still writes JSON less alike than code, so α
drops), a regex of indented Python lines on the code prompts, and like for like a regex that every output satisfies
on the JSON run's prompts (constrained and unconstrained write the same tokens: the ratio is the machinery's cost).
With `--pair smollm2` the prompts are chat requests asking for a JSON object the schema fits (rendered by the pair's
chat template; JSON schema and pass-through regex only). A mode's figure is tokens/s over its requests' summed wall
time; the ratios are medians over runs. The mask cost is the verifier's sampler time per token (constrained minus
unconstrained), and in process the time to compute one masked block row per token of the constrained outputs.
Writes `constrained.json` to benchmarks/results/ (or --out-dir).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

from benchmarks.constrained_plot import plot
from benchmarks.pairs import PAIR_NAMES, model_pair
from benchmarks.stack_runs import (
    RequestRun,
    environment,
    pinned_cores,
    prompt_texts,
    results_dir,
    timed_generate,
    totals,
    write_report_and_png,
)
from specdec.client import Client
from specdec.engine.cpu_affinity import pin_cpus
from specdec.local_stack import LocalStack
from specdec.sampling.constraints import ConstraintCompiler, ConstraintKind, ConstraintSpec
from specdec.v1 import common_pb2

MODES = ("constrained", "unconstrained", "constrained_plain")
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "version": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "options": {
            "type": "object",
            "properties": {"debug": {"type": "boolean"}, "level": {"enum": ["low", "high"]}},
            "required": ["debug", "level"],
        },
    },
    "required": ["name", "version", "tags", "options"],
}
PASSTHROUGH = r"[^\x00]*"  # any text without NUL: what the demo pair writes unconstrained
PYTHON_LINES = r"([ ]{4}[^\n]{0,78}\n){1,12}"  # indented Python lines: a function body as the code prompts open it
CONSTRAINTS = {  # name: (constraint, what every mode's prompts end with)
    "json_schema": (ConstraintSpec(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA)), "\nCONFIG = "),
    "python_lines_regex": (ConstraintSpec(ConstraintKind.REGEX, PYTHON_LINES), ""),
    # like for like: a regex every output satisfies, on the JSON run's prompts, so constrained and unconstrained
    # write the same tokens and the ratio is what the constraint's machinery costs, not the text
    "passthrough_regex": (ConstraintSpec(ConstraintKind.REGEX, PASSTHROUGH), "\nCONFIG = "),
}
CHAT_CONSTRAINTS = ("json_schema", "passthrough_regex")  # a chat pair's: its prompts ask for JSON, not for code
JSON_SUBJECTS = (  # what a chat pair's prompts ask it to describe as JSON
    "a command-line tool that resizes images",
    "a small web server for static files",
    "a weather app for phones",
    "a note-taking app",
    "a music player",
    "a password manager",
    "a chess engine",
    "a backup service for laptops",
)
HEADLINE_CONSTRAINT = "json_schema"
LIKE_FOR_LIKE_CONSTRAINT = "passthrough_regex"
FLOORS = {"vs_unconstrained": 0.8, "vs_constrained_plain": 1.5}
DENOMINATORS = {"vs_unconstrained": "unconstrained", "vs_constrained_plain": "constrained_plain"}


def as_proto(spec: ConstraintSpec) -> common_pb2.Constraint:
    return common_pb2.Constraint(**{spec.kind.value: spec.source})


def chat_json_prompts(tokenizer, count: int) -> list[str]:
    """`count` chat requests (rendered by the pair's chat template) that ask for a JSON object the schema fits."""
    return [
        tokenizer.apply_chat_template(
            [
                {
                    "role": "user",
                    "content": f"Describe {subject} as a JSON object with its name, a version number, up to four "
                    "tags, and options: debug (true or false) and level (low or high). Reply with the JSON only.",
                }
            ],
            add_generation_prompt=True,
            tokenize=False,
        )
        for subject in (JSON_SUBJECTS * (count // len(JSON_SUBJECTS) + 1))[:count]
    ]


def run_interleaved(
    client: Client, prompts: list[str], spec: ConstraintSpec, gamma: int, max_new_tokens: int, rotation: int
) -> dict[str, list[RequestRun]]:
    """Every prompt in every mode, back to back, the order rotating from prompt to prompt."""
    runs: dict[str, list[RequestRun]] = {mode: [] for mode in MODES}
    for index, prompt in enumerate(prompts):
        shift = (index + rotation) % len(MODES)
        for mode in MODES[shift:] + MODES[:shift]:
            constraint = None if mode == "unconstrained" else as_proto(spec)
            runs[mode].append(
                timed_generate(
                    client,
                    prompt,
                    max_new_tokens=max_new_tokens,
                    num_speculative_tokens=0 if mode == "constrained_plain" else gamma,
                    constraint=constraint,
                )
            )
    return runs


def mask_us_per_token(compiler: ConstraintCompiler, spec: ConstraintSpec, outputs: list[list[int]]) -> float:
    """In process: µs to compute one masked row per token of the outputs (a cursor's block_mask, one row at a
    time, as a plain step needs it)."""
    tokens, started = 0, time.perf_counter()
    for output in outputs:
        cursor = compiler.cursor(spec)
        for end in range(len(output)):
            cursor.block_mask(output[:end], [], 1)
        tokens += len(output)
    return round((time.perf_counter() - started) / max(tokens, 1) * 1e6, 2)


def summarize(per_run: list[dict[str, list[RequestRun]]]) -> dict:
    """Per mode its figures over all runs, and the ratios' medians over runs."""
    by_run = [{mode: totals(run[mode]) for mode in MODES} for run in per_run]
    ratios = {
        "vs_unconstrained": [r["constrained"]["tokens_per_s"] / r["unconstrained"]["tokens_per_s"] for r in by_run],
        "vs_constrained_plain": [
            r["constrained"]["tokens_per_s"] / r["constrained_plain"]["tokens_per_s"] for r in by_run
        ],
    }
    everything = {mode: totals([request for run in per_run for request in run[mode]]) for mode in MODES}
    sampler_us = {
        mode: round(
            sum(r.sampling_ns for run in per_run for r in run[mode])
            / max(sum(len(r.token_ids) for run in per_run for r in run[mode]), 1)
            / 1e3,
            2,
        )
        for mode in MODES
    }
    return {
        "ratio_median": {name: round(statistics.median(values), 4) for name, values in ratios.items()},
        "ratio_per_run": {name: [round(v, 4) for v in values] for name, values in ratios.items()},
        "verifier_sampler_us_per_token": sampler_us,
        "greedy_outputs_equal_plain": all(
            c.token_ids == p.token_ids for run in per_run for c, p in zip(run["constrained"], run["constrained_plain"])
        ),
        "modes": everything,
    }


def ratio_figure(result: dict, name: str, floor: float | None) -> dict:
    """One ratio of a constraint's result in the project's headline form: the median ratio, its two modes' tokens/s
    over all runs, and the floor with whether it is met (none for a figure without a floor)."""
    modes = result["modes"]
    figure = {
        "ratio": result["ratio_median"][name],
        "numerator": {"contender": "constrained", "tokens_per_s": modes["constrained"]["tokens_per_s"]},
        "denominator": {"contender": DENOMINATORS[name], "tokens_per_s": modes[DENOMINATORS[name]]["tokens_per_s"]},
    }
    if floor is not None:
        figure.update(floor=floor, meets=figure["ratio"] >= floor)
    return figure


def headline(results: dict) -> dict:
    """The issue's floors on the JSON schema, and beside them the like-for-like ratio (same text, no floor)."""
    top = results[HEADLINE_CONSTRAINT]
    figures = {
        "constrained_vs_unconstrained_speculative": ratio_figure(top, "vs_unconstrained", FLOORS["vs_unconstrained"]),
        "constrained_speculative_vs_constrained_plain": ratio_figure(
            top, "vs_constrained_plain", FLOORS["vs_constrained_plain"]
        ),
    }
    return {
        "constraint": HEADLINE_CONSTRAINT,
        **figures,
        "like_for_like_vs_unconstrained": {
            "constraint": LIKE_FOR_LIKE_CONSTRAINT,
            **ratio_figure(results[LIKE_FOR_LIKE_CONSTRAINT], "vs_unconstrained", None),
        },
        "floors": FLOORS,
        "meets": all(figure["meets"] for figure in figures.values()),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--pair", choices=PAIR_NAMES, default="demo", help="demo (code prompts) or smollm2 (chat prompts asking JSON)"
    )
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument(
        "--constraints", default=None, help="the constraints to run, comma-separated (default: all the pair's)"
    )
    parser.add_argument(
        "--adaptive-gamma", action="store_true", help="every mode under the coordinator's adaptive γ (γ the largest)"
    )
    parser.add_argument("--quick", action="store_true", help="2 prompts x 1 run x 24 tokens, to a temp folder")
    parser.add_argument("--out-dir", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.runs, args.max_new_tokens = 2, 1, 24
    out_dir = results_dir(args.out_dir, args.quick)
    pair = model_pair(args.pair)
    chat = pair.prompt_set == "chat"
    names = args.constraints.split(",") if args.constraints else list(CHAT_CONSTRAINTS if chat else CONSTRAINTS)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pair.draft)  # the pair's shared tokenizer (a GGUF target has none)
    prompts = chat_json_prompts(tokenizer, args.prompts) if chat else prompt_texts("code", args.prompts)
    pins = pinned_cores(1)
    cpus = {name: ["--cpus", cores] for name, cores in pins.items()}
    coordinator_args = [
        *pair.coordinator_flags,
        *([] if args.adaptive_gamma else ["--no-adaptive-gamma"]),
        *cpus.get("coordinator", []),
    ]
    results = {}
    with (
        LocalStack(
            pair.target,
            pair.draft,
            draft_args=["--threads", "1", *cpus.get("draft", [])],
            verify_args=["--threads", "1", *cpus.get("verify", [])],
            coordinator_args=coordinator_args,
        ) as stack,
        Client(stack.address) as client,
    ):
        if pins:
            pin_cpus(pins["coordinator"])
        compiler = ConstraintCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
        for name in names:
            spec, suffix = CONSTRAINTS[name]
            suffix = "" if chat else suffix  # a chat prompt asks for the JSON itself
            asking = [prompt + suffix for prompt in prompts]
            run_interleaved(client, asking[:1], spec, args.gamma, args.max_new_tokens, 0)  # warm-up, unmeasured
            per_run = []
            for index in range(args.runs):
                per_run.append(run_interleaved(client, asking, spec, args.gamma, args.max_new_tokens, index))
                figures = {mode: totals(per_run[-1][mode])["tokens_per_s"] for mode in MODES}
                print(
                    f"{name} run {index + 1}/{args.runs}: "
                    + ", ".join(f"{m} {v:.1f} tok/s" for m, v in figures.items())
                )
            outputs = [r.token_ids for run in per_run for r in run["constrained"]]
            results[name] = {
                "constraint": {spec.kind.value: spec.source},
                "prompt_suffix": suffix,
                "mask_us_per_token_in_process": mask_us_per_token(compiler, spec, outputs),
                **summarize(per_run),
            }
    report = {
        "benchmark": "constrained",
        "what": "greedy tokens/s of constrained speculative decoding against unconstrained speculative decoding and "
        "against constrained plain decoding (γ 0), through one stack, batch 1",
        "headline": headline(results) if {HEADLINE_CONSTRAINT, LIKE_FOR_LIKE_CONSTRAINT} <= results.keys() else None,
        "floors": FLOORS,
        "pair": pair.name,
        "target": pair.target,
        "draft": pair.draft,
        "gamma": args.gamma,
        "gamma_policy": "adaptive" if args.adaptive_gamma else "fixed",
        "prompts": args.prompts,
        "runs": args.runs,
        "max_new_tokens": args.max_new_tokens,
        "service_cpus": pins,
        "constraints": results,
        "environment": environment(),
    }
    write_report_and_png(out_dir / "constrained.json", report, plot)
    print(json.dumps(report["headline"], indent=2))
    return report


if __name__ == "__main__":
    main()
