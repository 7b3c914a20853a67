"""The target's own answers to chat prompts, with its top-k log-probabilities at each step.

Prompts (load_tests/chat_prompts.py's training side, or user turns the target wrote: self_prompts.py) are rendered
by the target's chat template and answered in batches of similar lengths (left-padded); two batches in three
greedy, one sampled at temperature 1, up to the end of the answer or a token budget. Each batch is saved as a file
of its own as soon as it is done, so a run stopped at its time limit resumes where it stopped (runs stay short on
shared cores).
"""

from __future__ import annotations

import pathlib
import random
import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from load_tests.chat_prompts import all_chat_prompts, chat_messages

TOP_K = 32


@dataclass(frozen=True)
class ChatAnswer:
    """One prompt and the target's answer: ids, and per answer position the target's top-k log-probabilities."""

    prompt_ids: list[int]
    answer_ids: list[int]  # up to and including the end-of-turn token, when reached
    top_logprobs: torch.Tensor  # [C, K] float16
    top_ids: torch.Tensor  # [C, K] int32
    sampled: bool  # True: drawn at temperature 1; False: greedy


def rendered_prompts(tokenizer: PreTrainedTokenizerBase, seed: int) -> list[list[int]]:
    """Every training-side chat prompt as the template's token ids, in a seeded order."""
    prompts = all_chat_prompts(held_out=False)
    random.Random(seed).shuffle(prompts)
    return [_ids(tokenizer.apply_chat_template(chat_messages(p), add_generation_prompt=True)) for p in prompts]


def rendered_messages(tokenizer: PreTrainedTokenizerBase, messages: list[str]) -> list[list[int]]:
    """User messages, each as a conversation of one, as the template's token ids."""
    return [
        _ids(tokenizer.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True))
        for m in messages
    ]


def _ids(encoded) -> list[int]:
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


@torch.inference_mode()
def answer_batch(
    target: PreTrainedModel, prompts: list[list[int]], new_tokens: int, greedy: bool, eos_id: int
) -> list[ChatAnswer]:
    """One batch of prompts answered together, left-padded with the end-of-turn id."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[eos_id] * (width - len(p)) + p for p in prompts])  # [B, P]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # [B, P]
    sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    out = target.generate(
        input_ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        output_logits=True,
        return_dict_in_generate=True,
        **sampling,
    )
    logits = torch.stack(out.logits, dim=1).float()  # [B, C, V]
    top = torch.log_softmax(logits, dim=-1).topk(TOP_K, dim=-1)
    answers = []
    for row, prompt in enumerate(prompts):
        continuation = out.sequences[row, width:].tolist()
        length = continuation.index(eos_id) + 1 if eos_id in continuation else len(continuation)
        answers.append(
            ChatAnswer(
                prompt,
                continuation[:length],
                top.values[row, :length].half(),
                top.indices[row, :length].int(),
                not greedy,
            )
        )
    return answers


def generate_chat_answers(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    out_dir: pathlib.Path,
    batch_size: int,
    new_tokens: int,
    seed: int,
    max_minutes: float,
) -> int:
    """Answers every prompt (template ids), batch by batch into out_dir/batch-NNNN.pt, skipping batches already
    there; stops after max_minutes. Returns the batches still to do."""
    out_dir.mkdir(parents=True, exist_ok=True)
    chunks = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
    torch.manual_seed(seed)
    started = time.time()
    done_now = 0
    for index, chunk in enumerate(chunks):
        path = out_dir / f"batch-{index:04d}.pt"
        if path.exists():
            continue
        if time.time() - started > max_minutes * 60:
            break
        chunk = sorted(chunk, key=len)  # similar lengths side by side: less padding
        answers = answer_batch(target, chunk, new_tokens, greedy=index % 3 != 2, eos_id=tokenizer.eos_token_id)
        torch.save(answers, path)
        done_now += 1
        tokens = sum(len(a.answer_ids) for a in answers)
        print(
            f"[chat answers] batch {index + 1}/{len(chunks)}: {tokens} answer tokens, "
            f"{(time.time() - started) / done_now:.0f}s a batch",
            flush=True,
        )
    return sum(not (out_dir / f"batch-{i:04d}.pt").exists() for i in range(len(chunks)))


def load_chat_answers(out_dir: pathlib.Path) -> list[ChatAnswer]:
    """Every answer saved in out_dir."""
    return [answer for path in sorted(out_dir.glob("batch-*.pt")) for answer in torch.load(path, weights_only=False)]
