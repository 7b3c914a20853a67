"""Measure the SmolLM2 draft beside the drafts that need no training, and write its model card.

    python -m smollm2_draft.measure                  # 40 held-out chat prompts, γ 4, T 0 and 1 (~3 min)
    python -m smollm2_draft.measure --cards-only     # rewrite README.md from measurements.json

With the project's in-process loop (`specdec.decoding.reference_loop`), one CPU thread each, the draft loaded as the
draft service runs it (its kernels and its subset head):
- α at temperature 0 and 1 and the cost ratio c (demo_pair/measure.py's step timing: one token after a warm cache,
  models in alternation, medians);
- the head: the share of the target's greedy answer tokens that the draft's head holds (outside it q = 0);
- self-speculation: the target's own first layers (as many as the draft has) with its own head (the demo pair's
  draft_from_target, no training): α at temperature 0 on the first prompts, and c;
- n-gram lookup (the NGRAM draft method's prompt lookup): α at temperature 0, replayed on the target's greedy answers
  (a lookup draft is accepted as far as it matches them), c ≈ 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import tempfile

import torch

from demo_pair.draft_distillation import draft_from_target
from demo_pair.measure import environment, measure_acceptance, measure_step_times, speedup_bound
from load_tests.chat_prompts import chat_messages, chat_prompts
from smollm2_draft.distillation import share_in_head
from smollm2_draft.model_card import write_card
from specdec.engine.model_runtime import LoadedModel, ModelSettings, check_same_vocabulary
from specdec.engine.smollm2_pair import SMOLLM2_DRAFT_DIR, smollm2_target
from specdec.engine.subset_head import read_head_ids
from specdec.sampling.prompt_lookup import lookup_continuation


def ngram_acceptance(prompts: list[list[int]], answers: list[list[int]], gamma: int) -> dict:
    """α of prompt lookup on greedy answers: each round drafts up to γ looked-up tokens, keeps those the answer
    has, then the target's next token; a round with nothing to look up drafts nothing."""
    drafted = accepted = rounds = 0
    for prompt, answer in zip(prompts, answers):
        position = 0
        while position < len(answer):
            proposal = lookup_continuation([*prompt, *answer[:position]], gamma)
            matched = next((i for i, (x, y) in enumerate(zip(proposal, answer[position:])) if x != y), len(proposal))
            matched = min(matched, len(answer) - position - 1)
            drafted, accepted, rounds = drafted + len(proposal), accepted + matched, rounds + 1
            position += matched + 1
    return {"acceptance_rate": round(accepted / max(1, drafted), 4), "drafted_tokens": drafted, "rounds": rounds}


def self_speculation_draft(target: LoadedModel, layers: int, directory: pathlib.Path) -> LoadedModel:
    """The target's embeddings, first `layers` layers, final norm and head, saved and loaded as a draft."""
    config = target.model.config.to_dict()
    config["num_hidden_layers"] = layers
    draft = draft_from_target(target.model, type(target.model.config).from_dict(config))
    draft.save_pretrained(directory)
    target.tokenizer.save_pretrained(directory)
    return LoadedModel.load(ModelSettings(str(directory), draft_kernels=True))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft-dir", type=pathlib.Path, default=SMOLLM2_DRAFT_DIR)
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--self-speculation-prompts", type=int, default=10)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--step-repeats", type=int, default=10, help="turns per model when timing steps (x8 calls)")
    parser.add_argument("--cards-only", action="store_true")
    args = parser.parse_args(argv)
    if args.cards_only:
        write_card(args.draft_dir, json.loads((args.draft_dir / "measurements.json").read_text()))
        return {}
    torch.set_num_threads(1)
    target = LoadedModel.load(ModelSettings(str(smollm2_target()), threads=1))
    draft = LoadedModel.load(ModelSettings(str(args.draft_dir), threads=1, draft_kernels=True))
    check_same_vocabulary(target.identity, draft.identity)
    prompts = [
        list(
            target.tokenizer.apply_chat_template(chat_messages(p), add_generation_prompt=True, return_dict=True)[
                "input_ids"
            ]
        )
        for p in chat_prompts(args.prompts, seed=0)
    ]
    context = max(prompts, key=len)
    steps = measure_step_times(target, draft, context, args.gamma, args.step_repeats)
    print(f"draft: c {steps['c']} (target {steps['target_step_ms']} ms)", flush=True)
    answers: list[list[int]] = []
    greedy = measure_acceptance(target, draft, prompts, args.gamma, 0.0, args.max_new_tokens, "T=0", answers)
    sampled = measure_acceptance(target, draft, prompts, args.gamma, 1.0, args.max_new_tokens, "T=1")
    layers = draft.model.config.num_hidden_layers
    with tempfile.TemporaryDirectory() as scratch:
        self_draft = self_speculation_draft(target, layers, pathlib.Path(scratch))
        self_steps = measure_step_times(target, self_draft, context, args.gamma, max(3, args.step_repeats // 3))
        few = prompts[: args.self_speculation_prompts]
        self_greedy = measure_acceptance(target, self_draft, few, args.gamma, 0.0, args.max_new_tokens, "self T=0")
    ngram = ngram_acceptance(prompts, answers, args.gamma)
    measurements = {
        "measured_at": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "environment": environment(),
        "gamma": args.gamma,
        "prompts": len(prompts),
        "prompt_set": "load_tests.chat_prompts.chat_prompts(seed=0), held-out topics, the target's chat template",
        "max_new_tokens": args.max_new_tokens,
        "threads": 1,
        "draft": {
            "temperature_0": greedy,
            "temperature_1": sampled,
            "step_times": steps,
            "speedup_bound_temperature_0": round(speedup_bound(greedy["acceptance_rate"], args.gamma, steps["c"]), 3),
            "speedup_bound_temperature_1": round(speedup_bound(sampled["acceptance_rate"], args.gamma, steps["c"]), 3),
            "weight_file_bytes": sum(p.stat().st_size for p in args.draft_dir.glob("*.safetensors")),
            "parameters": sum(p.numel() for p in draft.model.parameters()),
            "greedy_answer_tokens_in_head": round(share_in_head(answers, read_head_ids(str(args.draft_dir))), 4),
        },
        "self_speculation": {
            "layers": layers,
            "prompts": len(few),
            "temperature_0": self_greedy,
            "c": self_steps["c"],
            "draft_step_ms": self_steps["draft_step_ms"],
            "speedup_bound_temperature_0": round(
                speedup_bound(self_greedy["acceptance_rate"], args.gamma, self_steps["c"]), 3
            ),
        },
        "ngram": {
            "temperature_0": ngram,
            "speedup_bound_temperature_0": round(speedup_bound(ngram["acceptance_rate"], args.gamma, 0.0), 3),
        },
        "training": json.loads((args.draft_dir / "training.json").read_text()),
    }
    (args.draft_dir / "measurements.json").write_text(json.dumps(measurements, indent=2) + "\n")
    write_card(args.draft_dir, measurements)
    print(json.dumps({k: measurements[k] for k in ("draft", "self_speculation", "ngram")}, indent=1))
    return measurements


if __name__ == "__main__":
    main()
