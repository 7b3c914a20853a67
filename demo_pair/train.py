"""Train the embedded demo pair: tokenizer, Llama target, and a draft distilled from the target.

    python -m demo_pair.train all          # tokenizer, then target, then draft (resumes from checkpoints)
    python -m demo_pair.train target --target-steps 900
    python -m demo_pair.train draft --threads 2   # the target's continuations, then the draft (~30 min)

Outputs ordinary HF model directories (`models/demo-target`, `models/demo-draft`) plus a `training.json`
beside each with the figures the model card quotes. Checkpoints live in `--work-dir` so a run can resume.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from tokenizers import ByteLevelBPETokenizer
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from demo_pair.corpus import load_split
from demo_pair.draft_distillation import (
    GREEDY_TOKEN_WEIGHT,
    SAMPLED_TOKEN_WEIGHT,
    draft_from_target,
    sequence_distillation_loss,
)
from demo_pair.target_outputs import TOP_K, generate_target_outputs

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
EOS = "<|endoftext|>"
VOCAB_SIZE = 8192
CONTEXT = 1024


@dataclass(frozen=True)
class Shape:
    """Llama hyper-parameters of one model of the pair."""

    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int

    def config(self, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_attention_heads,
            max_position_embeddings=CONTEXT,
            tie_word_embeddings=True,
            bos_token_id=tokenizer.eos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )


# Deep and narrow: on CPU a step's cost is mostly per-layer work, so depth buys a target expensive enough per
# token for speculation to pay while the fp16 weights of both models stay under 64 MB.
TARGET_SHAPE = Shape(hidden_size=256, num_hidden_layers=24, intermediate_size=688, num_attention_heads=4)
# The draft shares the target's width so it can start from the target's bottom layers (draft_distillation.py).
DRAFT_SHAPE = Shape(hidden_size=256, num_hidden_layers=2, intermediate_size=688, num_attention_heads=4)
TARGET_OUTPUT_BATCHES = 48  # of 64 continuations of 128 tokens


BatchLoss = Callable[[LlamaForCausalLM, torch.Generator], torch.Tensor]  # (model, sampling generator) -> loss


@dataclass(frozen=True)
class RunSettings:
    """What one training stage needs to know."""

    steps: int
    batch_size: int
    seq_len: int
    learning_rate: float
    warmup_steps: int
    checkpoint_every: int
    seed: int


def train_tokenizer(tokenizer_dir: pathlib.Path) -> PreTrainedTokenizerFast:
    """Byte-level BPE over the training split, saved as HF tokenizer files."""
    texts = [f.text for f in load_split(held_out=False)]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=[EOS], show_progress=True)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=EOS, eos_token=EOS, pad_token=EOS)
    tokenizer.model_max_length = CONTEXT
    tokenizer.save_pretrained(tokenizer_dir)
    return tokenizer


def encode_split(tokenizer: PreTrainedTokenizerFast, held_out: bool) -> torch.Tensor:
    """All files of one split as one token stream, documents separated by EOS.  # [N]"""
    ids: list[int] = []
    for corpus_file in load_split(held_out):
        ids.extend(tokenizer(corpus_file.text)["input_ids"])
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def random_windows(stream: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """A batch of random contiguous windows of seq_len + 1 tokens.  # [B, T+1]"""
    starts = torch.randint(0, len(stream) - seq_len - 1, (batch_size,), generator=generator)
    return torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])


def held_out_windows(stream: torch.Tensor, seq_len: int, count: int = 64) -> torch.Tensor:
    """Fixed, evenly spaced evaluation windows.  # [count, T+1]"""
    stride = (len(stream) - seq_len - 1) // count
    return torch.stack([stream[i * stride : i * stride + seq_len + 1] for i in range(count)])


@torch.no_grad()
def evaluate_loss(model: LlamaForCausalLM, windows: torch.Tensor) -> float:
    """Mean next-token cross-entropy (nats/token) over the windows."""
    model.eval()
    losses = [model(input_ids=w[None, :-1], labels=w[None, :-1]).loss.item() for w in windows]
    model.train()
    return sum(losses) / len(losses)


def learning_rate(step: int, settings: RunSettings) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < settings.warmup_steps:
        return settings.learning_rate * (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps)
    return settings.learning_rate * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def corpus_loss(train_stream: torch.Tensor, settings: RunSettings) -> BatchLoss:
    """Next-token cross-entropy on random windows of the corpus."""

    def loss(model: LlamaForCausalLM, generator: torch.Generator) -> torch.Tensor:
        batch = random_windows(train_stream, settings.batch_size, settings.seq_len, generator)  # [B, T+1]
        logits = model(input_ids=batch[:, :-1]).logits  # [B, T, V]
        return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())

    return loss


def train(
    name: str,
    student: LlamaForCausalLM,
    settings: RunSettings,
    batch_loss: BatchLoss,
    work_dir: pathlib.Path,
) -> dict:
    """Train `student` by descending `batch_loss`, checkpointing to work_dir; resumable."""
    optimizer = torch.optim.AdamW(student.parameters(), lr=settings.learning_rate, betas=(0.9, 0.95), weight_decay=0.1)
    generator = torch.Generator().manual_seed(settings.seed)
    checkpoint_path = work_dir / f"{name}-checkpoint.pt"
    start_step, elapsed_before = 0, 0.0
    if checkpoint_path.exists():
        state = torch.load(checkpoint_path, weights_only=False)
        student.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        generator.set_state(state["generator"])
        start_step, elapsed_before = state["step"], state["elapsed_s"]
        print(f"[{name}] resumed at step {start_step}", flush=True)
    student.train()
    started = time.time()
    running_loss = None
    for step in range(start_step, settings.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, settings)
        loss = batch_loss(student, generator)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        running_loss = loss.item() if running_loss is None else 0.95 * running_loss + 0.05 * loss.item()
        done = step + 1
        if done % 10 == 0 or done == settings.steps:
            spent = time.time() - started
            rate = (done - start_step) / spent
            eta_min = (settings.steps - done) / rate / 60
            tokens_per_s = rate * settings.batch_size * settings.seq_len
            print(
                f"[{name}] step {done}/{settings.steps} loss {running_loss:.3f} lr {learning_rate(step, settings):.2e} "
                f"{tokens_per_s:.0f} tok/s eta {eta_min:.1f} min",
                flush=True,
            )
        if done % settings.checkpoint_every == 0 or done == settings.steps:
            torch.save(
                {
                    "model": student.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "generator": generator.get_state(),
                    "step": done,
                    "elapsed_s": elapsed_before + time.time() - started,
                },
                checkpoint_path,
            )
    state = torch.load(checkpoint_path, weights_only=False)
    return {
        "steps": settings.steps,
        "tokens_seen": settings.steps * settings.batch_size * settings.seq_len,
        "train_seconds": round(state["elapsed_s"], 1),
        "final_train_loss": round(running_loss, 4) if running_loss is not None else None,
        "settings": asdict(settings),
    }


def save_model(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    out_dir: pathlib.Path,
    stats: dict,
    eval_windows: torch.Tensor,
) -> None:
    """Save fp16 weights + tokenizer; the held-out loss is measured on the saved (fp16-rounded) weights."""
    model.to(torch.float16).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    reloaded = LlamaForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    stats["held_out_loss"] = round(evaluate_loss(reloaded, eval_windows), 4)
    stats["parameters"] = sum(p.numel() for p in reloaded.parameters())
    (out_dir / "training.json").write_text(json.dumps(stats, indent=2) + "\n")
    print(f"saved {out_dir}: held-out loss {stats['held_out_loss']} nats/token", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=["tokenizer", "target", "draft", "all"])
    parser.add_argument("--target-dir", type=pathlib.Path, default=REPO_ROOT / "models" / "demo-target")
    parser.add_argument("--draft-dir", type=pathlib.Path, default=REPO_ROOT / "models" / "demo-draft")
    parser.add_argument("--work-dir", type=pathlib.Path, default=REPO_ROOT / ".demo_pair_work")
    parser.add_argument("--target-steps", type=int, default=600)
    parser.add_argument("--draft-steps", type=int, default=900)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = args.work_dir / "tokenizer"

    if args.stage == "draft":  # the draft uses the trained target's tokenizer
        tokenizer = PreTrainedTokenizerFast.from_pretrained(args.target_dir)
    else:
        if args.stage == "tokenizer" or not (tokenizer_dir / "tokenizer.json").exists():  # training is deterministic
            train_tokenizer(tokenizer_dir)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    train_stream, eval_stream = encode_split(tokenizer, False), encode_split(tokenizer, True)
    print(
        f"corpus: {len(train_stream)} train tokens, {len(eval_stream)} held-out tokens "
        f"(Python {sys.version.split()[0]})",
        flush=True,
    )
    eval_windows = held_out_windows(eval_stream, seq_len=256)
    corpus_stats = {
        "python_version": sys.version.split()[0],
        "train_tokens": len(train_stream),
        "held_out_tokens": len(eval_stream),
    }

    if args.stage in ("target", "all"):
        settings = RunSettings(
            steps=args.target_steps,
            batch_size=8,
            seq_len=256,
            learning_rate=1.5e-3,
            warmup_steps=40,
            checkpoint_every=50,
            seed=1,
        )
        target = LlamaForCausalLM(TARGET_SHAPE.config(tokenizer))
        stats = train("target", target, settings, corpus_loss(train_stream, settings), args.work_dir)
        save_model(
            target, tokenizer, args.target_dir, {**corpus_stats, **stats, "shape": asdict(TARGET_SHAPE)}, eval_windows
        )

    if args.stage in ("draft", "all"):
        teacher = LlamaForCausalLM.from_pretrained(args.target_dir, dtype=torch.float32).eval()
        outputs = generate_target_outputs(
            teacher,
            train_stream,
            batches=TARGET_OUTPUT_BATCHES,
            batch_size=64,
            new_tokens=128,
            eos_id=tokenizer.eos_token_id,
            seed=3,
            cache_path=args.work_dir / "target-outputs.pt",
        )
        settings = RunSettings(
            steps=args.draft_steps,
            batch_size=16,
            seq_len=128,
            learning_rate=1e-3,
            warmup_steps=20,
            checkpoint_every=50,
            seed=2,
        )
        draft = draft_from_target(teacher, DRAFT_SHAPE.config(tokenizer))
        loss = sequence_distillation_loss(outputs, settings.batch_size)
        stats = train("draft", draft, settings, loss, args.work_dir)
        stats["distilled_from"] = (
            f"demo-target: started from its embeddings and bottom {DRAFT_SHAPE.num_hidden_layers} layers, trained on "
            f"its own continuations ({outputs.continuation_tokens():,} tokens, two thirds greedy, one third sampled at "
            f"temperature 1): cross-entropy to its distribution coarsened to the top {TOP_K} tokens and the rest, plus "
            f"cross-entropy on its tokens, weight {SAMPLED_TOKEN_WEIGHT} where sampled and {GREEDY_TOKEN_WEIGHT} where "
            "greedy"
        )
        save_model(
            draft, tokenizer, args.draft_dir, {**corpus_stats, **stats, "shape": asdict(DRAFT_SHAPE)}, eval_windows
        )


if __name__ == "__main__":
    main()
