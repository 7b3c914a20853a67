"""Measure the embedded pair and write its model cards.

    python -m demo_pair.measure                 # 50 held-out code prompts, γ = 4, temperature 0 and 1
    python -m demo_pair.measure --prompts 5 --max-new-tokens 16 --step-repeats 5   # a quick look

Loads `models/demo-target` and `models/demo-draft`, refuses them unless their tokenizers match, then
measures with the project's own in-process speculative loop (`specdec.decoding.reference_loop`):

- acceptance rate α = accepted / drafted over every round of every prompt, at temperature 0 and 1;
- cost ratio c = draft step time / target step time: one token at batch 1 after a warm KV cache of a
  held-out prompt, same thread count for both, the two models timed in alternation, medians;
- the analytic speedup bound E / (1 + γc) with E = (1 - α^(γ+1)) / (1 - α) (../shared/DESIGN.md).

Writes `measurements.json` into each model directory and (re)writes each directory's `README.md` model
card from it and from the `training.json` that `python -m demo_pair.train` left there.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import sys
import time
from collections.abc import Sequence

import torch
import transformers

from demo_pair.corpus import HELD_OUT_PERCENT
from load_tests.prompts import code_prompts
from specdec.decoding.reference_loop import speculative_generate
from specdec.engine.embedded_pair import DEMO_DRAFT_DIR, DEMO_TARGET_DIR
from specdec.engine.model_runtime import LoadedModel, ModelSettings, check_same_vocabulary
from specdec.sampling.rules import SamplingParams
from specdec.sampling.speculation_stats import SpeculationStats


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    """E = (1 - α^(γ+1)) / (1 - α): tokens a round commits when each draft token is accepted with prob. α."""
    return gamma + 1.0 if alpha >= 1.0 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def speedup_bound(alpha: float, gamma: int, c: float) -> float:
    """The design's analytic speedup over target-only decoding: E / (1 + γc)."""
    return expected_tokens_per_round(alpha, gamma) / (1 + gamma * c)


def measure_acceptance(
    target: LoadedModel,
    draft: LoadedModel,
    prompts: Sequence[Sequence[int]],
    gamma: int,
    temperature: float,
    max_new_tokens: int,
    label: str,
    completions: list[list[int]] | None = None,
) -> dict:
    """α and the per-position acceptance over every round of every prompt (seed i for prompt i); each completion
    is appended to `completions` when given."""
    total = SpeculationStats()
    generated = 0
    started = time.perf_counter()
    for i, prompt_ids in enumerate(prompts):
        result = speculative_generate(
            target, draft, prompt_ids, gamma, SamplingParams(temperature=temperature, seed=i), max_new_tokens
        )
        stats = result.stats
        total.rounds += stats.rounds
        total.drafted += stats.drafted
        total.accepted += stats.accepted
        for position, (drafted, accepted) in enumerate(zip(stats.drafted_per_position, stats.accepted_per_position)):
            if position == len(total.drafted_per_position):
                total.drafted_per_position.append(0)
                total.accepted_per_position.append(0)
            total.drafted_per_position[position] += drafted
            total.accepted_per_position[position] += accepted
        generated += len(result.token_ids)
        if completions is not None:
            completions.append(result.token_ids)
        print(
            f"[{label}] prompt {i + 1}/{len(prompts)}: α so far {total.acceptance_rate:.3f} "
            f"({total.accepted}/{total.drafted}), {time.perf_counter() - started:.0f}s",
            flush=True,
        )
    return {
        "temperature": temperature,
        "acceptance_rate": round(total.acceptance_rate, 4),
        "mean_accepted_length": round(total.mean_accepted_length, 4),
        "rounds": total.rounds,
        "drafted_tokens": total.drafted,
        "accepted_tokens": total.accepted,
        "generated_tokens": generated,
        "acceptance_by_position": [
            round(a / d, 4) if d else None for a, d in zip(total.accepted_per_position, total.drafted_per_position)
        ],
    }


@torch.inference_mode()
def _time_forward(model: LoadedModel, cache, token_ids: list[int]) -> float:
    """Seconds for one forward pass of token_ids after the cached prefix; the cache is cropped back after."""
    input_ids = torch.tensor([token_ids], dtype=torch.long)  # [1, T]
    started = time.perf_counter()
    model.forward(input_ids, cache)
    elapsed = time.perf_counter() - started
    cache.crop(-len(token_ids))
    return elapsed


def measure_step_times(
    target: LoadedModel,
    draft: LoadedModel,
    context_ids: Sequence[int],
    gamma: int,
    repeats: int,
    steps_per_repeat: int = 8,
) -> dict:
    """Median one-token step of each model and the target's (γ+1)-token scoring step, over a warm cache.

    Both caches hold the same held-out context. The models take turns, `steps_per_repeat` calls each per
    turn, so drift on a shared machine hits them alike.
    """
    caches = {}
    for name, model in (("target", target), ("draft", draft)):
        cache = model.new_cache()
        model.forward(torch.tensor([list(context_ids)], dtype=torch.long), cache)  # warm KV cache
        caches[name] = cache
    next_token = [int(context_ids[-1])]
    block = [int(t) for t in context_ids[-(gamma + 1) :]]
    for _ in range(3):  # warm-up: allocator, kernels
        _time_forward(target, caches["target"], next_token)
        _time_forward(draft, caches["draft"], next_token)
        _time_forward(target, caches["target"], block)
    samples: dict[str, list[float]] = {"target_step": [], "draft_step": [], "target_verify": []}
    for _ in range(repeats):
        for _ in range(steps_per_repeat):
            samples["draft_step"].append(_time_forward(draft, caches["draft"], next_token))
        for _ in range(steps_per_repeat):
            samples["target_step"].append(_time_forward(target, caches["target"], next_token))
        for _ in range(steps_per_repeat):
            samples["target_verify"].append(_time_forward(target, caches["target"], block))
    medians = {name: statistics.median(values) for name, values in samples.items()}
    return {
        "context_tokens": len(context_ids),
        "samples_per_figure": repeats * steps_per_repeat,
        "target_step_ms": round(medians["target_step"] * 1e3, 3),
        "draft_step_ms": round(medians["draft_step"] * 1e3, 3),
        f"target_verify_{gamma + 1}_tokens_ms": round(medians["target_verify"] * 1e3, 3),
        "c": round(medians["draft_step"] / medians["target_step"], 4),
        "verify_over_step": round(medians["target_verify"] / medians["target_step"], 3),
    }


def describe_model(model: LoadedModel, model_dir: pathlib.Path) -> dict:
    """Sizes of one model as loaded, plus the bytes of its weight files."""
    config = model.model.config
    stored = json.loads((model_dir / "config.json").read_text())  # the loaded copy is float32; the file may not be
    weight_bytes = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    return {
        "parameters": sum(p.numel() for p in model.model.parameters()),
        "layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "attention_heads": config.num_attention_heads,
        "vocab_size": config.vocab_size,
        "context_tokens": config.max_position_embeddings,
        "weights_dtype": stored.get("dtype") or stored.get("torch_dtype") or "unknown",
        "weight_file_bytes": weight_bytes,
    }


def read_training(model_dir: pathlib.Path) -> dict:
    path = model_dir / "training.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _fmt_params(count: int) -> str:
    return f"{count / 1e6:.2f}M" if count >= 1e6 else f"{count / 1e3:.0f}k"


def model_card(role: str, model_dir: pathlib.Path, partner_dir: pathlib.Path, measurements: dict) -> str:
    """The README.md of one model directory, from measurements.json and training.json."""
    me, partner = measurements[role], measurements["draft" if role == "target" else "target"]
    training, size = me["training"], me["size"]
    pair, steps = measurements["pair"], measurements["pair"]["step_times"]
    t0, t1 = pair["temperature_0"], pair["temperature_1"]
    gamma = pair["gamma"]
    train_settings = training.get("settings", {})
    corpus = measurements["corpus"]
    held_out_loss = training.get("held_out_loss")
    partner_loss = partner["training"].get("held_out_loss")
    title = "demo target" if role == "target" else "demo draft"
    if role == "target":
        purpose = (
            f"The **target** of the stack's embedded demo pair: the model whose distribution the served output "
            f"follows. Its draft is [`{partner_dir.name}`](../{partner_dir.name})."
        )
        how_trained = "Trained from random initialisation on the training split (next-token cross-entropy)."
    else:
        purpose = (
            f"The **draft** of the stack's embedded demo pair: it proposes γ tokens that "
            f"[`{partner_dir.name}`](../{partner_dir.name}) verifies in one forward pass."
        )
        how_trained = f"Distilled from {training.get('distilled_from', 'the target')}."
    minutes = training.get("train_seconds", 0) / 60
    lines = [
        "---",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags: [llama, speculative-decoding, python-code, demo]",
        "---",
        "",
        f"# {model_dir.name} — {title} model (Llama, byte-level BPE)",
        "",
        purpose,
        "It is a small code model for demos, tests and benchmarks that run offline on CPU, not a useful "
        "code assistant.",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'model = AutoModelForCausalLM.from_pretrained("models/{model_dir.name}")',
        f'tokenizer = AutoTokenizer.from_pretrained("models/{model_dir.name}")',
        "```",
        "",
        "## Corpus",
        f"The Python standard library source of the interpreter that ran the training (Python "
        f"{corpus.get('python_version', '?')}), every `.py` file except tests (`test/`, `tests/`, `idle_test/`, "
        f"`test_*.py`, `site-packages/`), split **by file**: a file is held out when the SHA-256 of its path falls in "
        f"the last {HELD_OUT_PERCENT}%. Train split {corpus.get('train_tokens', 0):,} tokens, held-out split "
        f"{corpus.get('held_out_tokens', 0):,} tokens. Tokenizer: byte-level BPE (HF `tokenizers`), vocabulary "
        f"{size['vocab_size']:,}, trained on the training split; `<|endoftext|>` separates files and is EOS. Both "
        f"models of the pair share this tokenizer.",
        "",
        "## Size",
        "| | |",
        "| --- | --- |",
        f"| parameters | {size['parameters']:,} ({_fmt_params(size['parameters'])}; embeddings tied) |",
        f"| layers | {size['layers']} |",
        f"| hidden size / MLP size | {size['hidden_size']} / {size['intermediate_size']} |",
        f"| attention heads | {size['attention_heads']} |",
        f"| vocabulary | {size['vocab_size']:,} |",
        f"| context | {size['context_tokens']} tokens |",
        f"| weight file | {size['weight_file_bytes'] / 1e6:.1f} MB ({size['weights_dtype']} safetensors) |",
        "",
        "## Training",
        how_trained,
        "",
        "| | |",
        "| --- | --- |",
        f"| steps | {training.get('steps', '?')} (batch {train_settings.get('batch_size', '?')} × "
        f"{train_settings.get('seq_len', '?')} tokens) |",
        f"| tokens seen | {training.get('tokens_seen', 0):,} |",
        f"| time | {minutes:.1f} min of CPU training |",
        f"| peak learning rate | {train_settings.get('learning_rate', '?')} "
        f"(warm-up {train_settings.get('warmup_steps', '?')} steps, cosine to 10%) |",
        f"| final training loss | {training.get('final_train_loss', '?')} |",
        f"| **held-out loss** | **{held_out_loss} nats/token** (partner: {partner_loss}) |",
        "",
        "Held-out loss: mean next-token cross-entropy over 64 evenly spaced 256-token windows of the held-out split, "
        "measured on the saved fp16 weights.",
        "",
        "## Measured with the project's speculative loop",
        f"Target `{pair['target']}` with draft `{pair['draft']}`, γ = {gamma}, "
        f"{pair['prompts']} held-out code prompts (windows of held-out stdlib files, "
        f"`load_tests.prompts.code_prompts`), up to {pair['max_new_tokens']} new tokens each, "
        f"in-process loop `specdec.decoding.reference_loop.speculative_generate`.",
        "",
        "| figure | value |",
        "| --- | --- |",
        f"| acceptance rate α, temperature 0 | **{t0['acceptance_rate']:.3f}** (mean accepted length "
        f"{t0['mean_accepted_length']:.2f} tokens/round) |",
        f"| acceptance rate α, temperature 1 | **{t1['acceptance_rate']:.3f}** (mean accepted length "
        f"{t1['mean_accepted_length']:.2f} tokens/round) |",
        f"| share of rounds whose draft token 1, 2, … was accepted, temperature 0 | "
        f"{', '.join(f'{a:.2f}' for a in t0['acceptance_by_position'] if a is not None)} |",
        f"| target step (1 token, warm cache) | {steps['target_step_ms']:.2f} ms |",
        f"| draft step (1 token, warm cache) | {steps['draft_step_ms']:.2f} ms |",
        f"| target scoring {gamma + 1} tokens at once | {steps[f'target_verify_{gamma + 1}_tokens_ms']:.2f} ms "
        f"({steps['verify_over_step']:.2f}× a step) |",
        f"| **cost ratio c** = draft step / target step | **{steps['c']:.4f}** "
        f"(target step = {1 / steps['c']:.1f}× draft step) |",
        f"| analytic bound E/(1+γc), temperature 0 | {pair['speedup_bound_temperature_0']:.2f}× |",
        f"| analytic bound E/(1+γc), temperature 1 | {pair['speedup_bound_temperature_1']:.2f}× |",
        "",
        f"Step times: batch 1, {pair['threads']} CPU thread(s) for both models, after a warm KV cache of "
        f"{steps['context_tokens']} prompt tokens, medians of {steps['samples_per_figure']} calls with the models "
        f"timed in alternation. The bound assumes scoring γ+1 tokens costs one step; on CPU it costs "
        f"{steps['verify_over_step']:.2f}× ({measurements['environment']['machine']}).",
        "",
        "## Reproduce",
        "```bash",
        "python -m demo_pair.train all    # tokenizer, target, then the distilled draft "
        "(resumes from .demo_pair_work/)",
        "python -m demo_pair.measure      # the figures above: measurements.json and this README",
        "```",
        f"Measured {measurements['measured_at']} with Python {measurements['environment']['python']}, torch "
        f"{measurements['environment']['torch']}, transformers {measurements['environment']['transformers']}.",
        "",
    ]
    return "\n".join(lines)


def environment() -> dict:
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target-dir", type=pathlib.Path, default=DEMO_TARGET_DIR)
    parser.add_argument("--draft-dir", type=pathlib.Path, default=DEMO_DRAFT_DIR)
    parser.add_argument("--prompts", type=int, default=50, help="held-out code prompts (>= 50 for the model cards)")
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads for both models")
    parser.add_argument("--step-repeats", type=int, default=25, help="turns per model when timing steps (x8 calls)")
    parser.add_argument("--seed", type=int, default=0, help="prompt selection seed")
    parser.add_argument("--no-write", action="store_true", help="print the figures, write nothing")
    parser.add_argument(
        "--cards-only",
        action="store_true",
        help="measure nothing: rewrite each README.md from the measurements.json already there",
    )
    args = parser.parse_args(argv)
    if args.cards_only:
        measurements = json.loads((args.target_dir / "measurements.json").read_text())
        write_cards(args.target_dir, args.draft_dir, measurements)
        return measurements

    torch.set_num_threads(args.threads)
    target = LoadedModel.load(ModelSettings(str(args.target_dir), threads=args.threads))
    draft = LoadedModel.load(ModelSettings(str(args.draft_dir), threads=args.threads))
    check_same_vocabulary(target.identity, draft.identity)
    print(f"tokenizers match (sha256 {target.identity.tokenizer_sha256[:12]}…)", flush=True)

    prompts = code_prompts(args.prompts, seed=args.seed)
    prompt_ids = [target.tokenizer(p.prompt, add_special_tokens=False)["input_ids"] for p in prompts]
    steps = measure_step_times(target, draft, max(prompt_ids, key=len), args.gamma, args.step_repeats)
    print(
        f"steps: target {steps['target_step_ms']} ms, draft {steps['draft_step_ms']} ms, c = {steps['c']}", flush=True
    )
    by_temperature = {
        t: measure_acceptance(target, draft, prompt_ids, args.gamma, t, args.max_new_tokens, f"T={t:g}")
        for t in (0.0, 1.0)
    }

    trainings = {"target": read_training(args.target_dir), "draft": read_training(args.draft_dir)}
    corpus = {
        key: trainings["target"][key]
        for key in ("python_version", "train_tokens", "held_out_tokens")
        if key in trainings["target"]
    }
    measurements = {
        "measured_at": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "environment": environment(),
        "corpus": corpus,
        "pair": {
            "target": args.target_dir.name,
            "draft": args.draft_dir.name,
            "tokenizer_sha256": target.identity.tokenizer_sha256,
            "gamma": args.gamma,
            "prompts": len(prompt_ids),
            "prompt_set": f"load_tests.prompts.code_prompts(seed={args.seed})",
            "max_new_tokens": args.max_new_tokens,
            "threads": args.threads,
            "temperature_0": by_temperature[0.0],
            "temperature_1": by_temperature[1.0],
            "step_times": steps,
            "speedup_bound_temperature_0": round(
                speedup_bound(by_temperature[0.0]["acceptance_rate"], args.gamma, steps["c"]), 3
            ),
            "speedup_bound_temperature_1": round(
                speedup_bound(by_temperature[1.0]["acceptance_rate"], args.gamma, steps["c"]), 3
            ),
        },
        "target": {"size": describe_model(target, args.target_dir), "training": trainings["target"]},
        "draft": {"size": describe_model(draft, args.draft_dir), "training": trainings["draft"]},
    }
    pair = measurements["pair"]
    print(
        json.dumps(
            {
                "alpha_temperature_0": pair["temperature_0"]["acceptance_rate"],
                "alpha_temperature_1": pair["temperature_1"]["acceptance_rate"],
                "c": steps["c"],
                "held_out_loss_target": trainings["target"].get("held_out_loss"),
                "held_out_loss_draft": trainings["draft"].get("held_out_loss"),
                "speedup_bound_temperature_0": pair["speedup_bound_temperature_0"],
            },
            indent=2,
        )
    )
    if not args.no_write:
        for model_dir in (args.target_dir, args.draft_dir):
            (model_dir / "measurements.json").write_text(json.dumps(measurements, indent=2) + "\n")
        write_cards(args.target_dir, args.draft_dir, measurements)
    return measurements


def write_cards(target_dir: pathlib.Path, draft_dir: pathlib.Path, measurements: dict) -> None:
    for role, model_dir, partner_dir in (("target", target_dir, draft_dir), ("draft", draft_dir, target_dir)):
        (model_dir / "README.md").write_text(model_card(role, model_dir, partner_dir, measurements))
        print(f"wrote {model_dir / 'README.md'}")


if __name__ == "__main__":
    main()
