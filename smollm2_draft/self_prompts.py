"""Chat prompts the target writes itself, for distillation data beyond the question templates.

The target's chat template up to the opening of a user turn is sampled (temperature 1, top-p 0.95) to the end of
that turn: the target writes a message a user might send (the pre-query-template method, "Magpie", Xu et al.,
2024). A turn is kept when it ended, is at least MIN_TOKENS long, is not a repeat, and names no held-out topic of
load_tests/chat_prompts.py (its words, the last by its stem): the draft still never trains on a held-out subject.
Turns are written to a JSON file batch by batch, so a stopped run resumes.
"""

from __future__ import annotations

import json
import pathlib
import re
import time

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from load_tests.chat_prompts import GENERAL_TOPICS, MODULE_TOPICS, is_held_out

MIN_TOKENS = 6
TOP_P = 0.95


def held_out_pattern() -> re.Pattern[str]:
    """A case-insensitive match of every held-out topic: its words (without "the"), the last one by its stem and
    any ending ("gardening" matches "garden", "gardener"; "New York" matches "New Yorker")."""
    names = []
    for topic in (t for t in (*GENERAL_TOPICS, *MODULE_TOPICS) if is_held_out(t)):
        *first, last = topic.removeprefix("the ").split()
        stem = re.sub(r"(?<=\w{3})ing$", "", last)
        stem = re.sub(r"(?<=x)es$|(?<=ch|sh|ss)es$|(?<=\w{2})s$", "", stem) if stem == last else stem
        names.append(r"\s+".join([*map(re.escape, first), re.escape(stem) + r"\w*"]))
    return re.compile(r"\b(?:" + "|".join(names) + ")", re.IGNORECASE)


def user_turn_prefix(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The template's ids up to where a user message's text begins (its system prompt included)."""
    marker = "\x00USER\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    return tokenizer(text[: text.index(marker)], add_special_tokens=False)["input_ids"]


@torch.inference_mode()
def sample_user_turns(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prefix_ids: list[int],
    batch_size: int,
    max_tokens: int,
    end_id: int,
) -> list[str]:
    """One batch of user turns after prefix_ids (user_turn_prefix), those that reached the end of their turn
    (decoded, stripped)."""
    prefix = torch.tensor([prefix_ids] * batch_size)  # [B, P]
    out = target.generate(
        prefix,
        attention_mask=torch.ones_like(prefix),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=TOP_P,
        max_new_tokens=max_tokens,
        eos_token_id=end_id,
        pad_token_id=end_id,
    )
    turns = []
    for row in out[:, prefix.shape[1] :].tolist():
        if end_id in row and row.index(end_id) >= MIN_TOKENS:
            turns.append(tokenizer.decode(row[: row.index(end_id)]).strip())
    return turns


def generate_self_prompts(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    path: pathlib.Path,
    count: int,
    batch_size: int,
    max_tokens: int,
    seed: int,
) -> list[str]:
    """Up to `count` kept user turns in `path` (a JSON list, extended a batch at a time; resumes from it)."""
    held_out = held_out_pattern()
    kept = [t for t in (json.loads(path.read_text()) if path.exists() else []) if not held_out.search(t)]
    end_id, prefix_ids = tokenizer.convert_tokens_to_ids("<|im_end|>"), user_turn_prefix(tokenizer)
    started, batches = time.time(), 0
    while len(kept) < count:
        torch.manual_seed(seed * 100_003 + len(kept) * 101 + batches)
        turns = sample_user_turns(target, tokenizer, prefix_ids, batch_size, max_tokens, end_id)
        seen = set(kept)
        fresh = [t for t in dict.fromkeys(turns) if t not in seen and t and not held_out.search(t)]
        kept.extend(fresh[: count - len(kept)])
        path.write_text(json.dumps(kept, indent=0, ensure_ascii=False) + "\n")
        batches += 1
        print(
            f"[self prompts] {len(kept)}/{count} kept ({len(fresh)} of {batch_size} this batch), "
            f"{(time.time() - started) / batches:.0f}s a batch",
            flush=True,
        )
    return kept[:count]
