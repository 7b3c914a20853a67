"""Make the SmolLM2 draft: the target's answers to chat prompts, then a narrow draft distilled on them.

    python -m smollm2_draft.train answers --max-minutes 18   # the target's answers, resumable (~10 min in all)
    python -m smollm2_draft.train self-answers --self-prompts 4800   # user turns the target writes, and its answers
    python -m smollm2_draft.train json-answers --json-answers 1536   # its answers to requests for JSON (~7 min)
    python -m smollm2_draft.train draft --layers 2 --steps 800          # distil a draft (resumes from its checkpoint)
    python -m smollm2_draft.train draft --deepen models/smollm2-draft   # start from that one (grown to --layers)
    python -m smollm2_draft.train draft --answer-sets template,json     # on some of the answer sets only

The target is the pinned GGUF (fetched by `python -m specdec fetch`); it answers in bfloat16 (3× the float32
rate on these cores; its answers are the same text up to near-ties). Work files live in `--work-dir`. The
draft is written to models/smollm2-draft with its head's ids and a training.json the model card quotes
(`python -m smollm2_draft.measure`).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from demo_pair.train import RunSettings, train
from smollm2_draft.chat_outputs import (
    TOP_K,
    generate_chat_answers,
    load_chat_answers,
    rendered_messages,
    rendered_prompts,
)
from smollm2_draft.distillation import (
    DRAFT_LAYERS,
    HEAD_TOKENS,
    deepened_draft,
    distillation_loss,
    head_token_ids,
    layer_dropped_draft,
    share_in_head,
    trained_draft,
)
from smollm2_draft.json_answers import generate_json_answers, load_json_answers
from smollm2_draft.model_card import ANSWER_SET_NAMES
from smollm2_draft.self_prompts import generate_self_prompts
from specdec.engine.borrowed_embeddings import EMBEDDING_TENSOR, write_embeddings_source
from specdec.engine.gguf_checkpoint import resolve_model
from specdec.engine.smollm2_pair import SMOLLM2_DRAFT_DIR, SMOLLM2_WHEEL, smollm2_target
from specdec.engine.subset_head import write_head_ids

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def save_draft(
    draft: LlamaForCausalLM, target_dir: pathlib.Path, out_dir: pathlib.Path, kept: list[int], stats: dict
) -> None:
    """float16 weights but the borrowed embedding, where that comes from, the target's tokenizer files, the head's
    ids and training.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_embeddings_source(out_dir, SMOLLM2_WHEEL, draft.get_input_embeddings().weight)
    draft = draft.to(torch.float16)
    own = {
        name: tensor for name, tensor in draft.state_dict().items() if name not in (EMBEDDING_TENSOR, "lm_head.weight")
    }
    draft.save_pretrained(out_dir, state_dict=own)
    for name in TOKENIZER_FILES:
        if (target_dir / name).exists():
            shutil.copy(target_dir / name, out_dir / name)
    write_head_ids(out_dir, kept, f"the {len(kept)} ids the target's training answers use most")
    stats["parameters"] = sum(p.numel() for p in draft.parameters())
    stats["parameters_shipped"] = sum(tensor.numel() for tensor in own.values())
    (out_dir / "training.json").write_text(json.dumps(stats, indent=2) + "\n")
    print(f"saved {out_dir}", flush=True)


def answer_sets(text: str) -> set[str]:
    """--answer-sets: comma-separated names of answer sets, each one the card knows."""
    names = set(text.split(","))
    if unknown := sorted(names - set(ANSWER_SET_NAMES)):
        raise argparse.ArgumentTypeError(f"unknown answer sets {unknown}: choose among {', '.join(ANSWER_SET_NAMES)}")
    return names


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=["answers", "self-answers", "json-answers", "draft"])
    parser.add_argument("--work-dir", type=pathlib.Path, default=REPO_ROOT / ".smollm2_work")
    parser.add_argument("--draft-dir", type=pathlib.Path, default=SMOLLM2_DRAFT_DIR)
    parser.add_argument("--max-minutes", type=float, default=18.0, help="answers: stop after this long (resume later)")
    parser.add_argument("--self-prompts", type=int, default=4800, help="self-answers: user turns to write")
    parser.add_argument("--json-answers", type=int, default=1536, help="json-answers: requests for JSON to answer")
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument(
        "--layers", type=int, default=DRAFT_LAYERS, help="the draft's depth (the target's first layers)"
    )
    parser.add_argument(
        "--deepen",
        type=pathlib.Path,
        help="start from this trained draft, as deep or shallower (its training.json is kept)",
    )
    parser.add_argument(
        "--answer-sets",
        type=answer_sets,
        default=",".join(ANSWER_SET_NAMES),
        help=f"draft: the answers to train on, of those generated ({', '.join(ANSWER_SET_NAMES)}; model_card.py)",
    )
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="peak (warm-up 20 steps, cosine to 10%%)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    target_dir = pathlib.Path(resolve_model(str(smollm2_target())))
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    answers_dir, self_answers_dir = args.work_dir / "chat-answers", args.work_dir / "self-answers"
    json_answers_path = args.work_dir / "json-answers.pt"

    if args.stage in ("answers", "self-answers", "json-answers"):
        target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).eval()
        if args.stage == "json-answers":
            generate_json_answers(target, tokenizer, json_answers_path, args.json_answers, 64, 128, seed=2)
            return
        if args.stage == "answers":
            prompts, out_dir = rendered_prompts(tokenizer, seed=0), answers_dir
        else:
            args.work_dir.mkdir(parents=True, exist_ok=True)
            turns = generate_self_prompts(
                target, tokenizer, args.work_dir / "self-prompts.json", args.self_prompts, 64, 64, seed=1
            )
            prompts, out_dir = rendered_messages(tokenizer, turns), self_answers_dir
        left = generate_chat_answers(target, tokenizer, prompts, out_dir, 64, 128, seed=0, max_minutes=args.max_minutes)
        print(f"{left} batches left" if left else "all answers done", flush=True)
        return

    sets = args.answer_sets
    template = load_chat_answers(answers_dir) if "template" in sets else []
    self_made = load_chat_answers(self_answers_dir) if "self" in sets else []
    as_json = load_json_answers(json_answers_path) if "json" in sets else []
    answers = template + self_made + as_json
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    kept = head_token_ids(answers, HEAD_TOKENS, always=sorted(tokenizer.all_special_ids))
    answer_tokens = sum(len(a.answer_ids) for a in answers)
    print(
        f"{len(answers)} answers, {answer_tokens} tokens; head of {len(kept)} ids covers "
        f"{share_in_head([a.answer_ids for a in answers], kept):.4f} of them",
        flush=True,
    )
    settings = RunSettings(
        steps=args.steps,
        batch_size=16,
        seq_len=0,
        learning_rate=args.learning_rate,
        warmup_steps=20,
        checkpoint_every=50,
        seed=2,
    )
    draft, deepened_from = layer_dropped_draft(target, args.layers), None
    if args.deepen:
        deepened_from = json.loads((args.deepen / "training.json").read_text())
        shallower = trained_draft(target, args.deepen, deepened_from["shape"]["layers"])
        draft = deepened_draft(shallower, target, args.layers)
    started = time.time()
    loss = distillation_loss(answers, kept, settings.batch_size, tokenizer.pad_token_id, target.config.vocab_size)
    continued = f"-continued-on-{'-'.join(sorted(sets))}" if args.deepen else ""
    run_name = f"smollm2-draft-{args.layers}-layers{continued}"  # its checkpoint's name: one a run of the chain
    stats = train(run_name, draft, settings, loss, args.work_dir)
    sampled = sum(a.sampled for a in answers)
    stats.update(
        shape={"layers": args.layers, "of_target_layers": target.config.num_hidden_layers},
        deepened_from=deepened_from,
        head_tokens=len(kept),
        head_coverage_of_training_answers=round(share_in_head([a.answer_ids for a in answers], kept), 4),
        training_data={
            "answers": len(answers),
            "answer_tokens": answer_tokens,
            "sampled_answers": sampled,
            "greedy_answers": len(answers) - sampled,
            "teacher_top_k": TOP_K,
            "prompts": "load_tests.chat_prompts, training side of the topic split",
            "answers_to_self_written_prompts": len(self_made),
            "answers_to_requests_for_json": len(as_json),
        },
        wall_seconds_this_run=round(time.time() - started, 1),
    )
    save_draft(draft, target_dir, args.draft_dir, kept, stats)


if __name__ == "__main__":
    main()
