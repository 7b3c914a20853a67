"""The benchmark's fixed prompt sets: token-id windows cut from held-out stdlib files ("code"), and the load
tests' input-grounded prompts that quote a held-out function and ask for it back ("grounded").

Prompts are token ids, so every contender (HF generate, the in-process loops and the gRPC stack) starts
from exactly the same sequence. A tokenizer without a code vocabulary (the word-level tokenizer of the
tiny test models maps source text to its unknown token) gets deterministic random ids instead.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from load_tests.chat_prompts import chat_messages, chat_prompts
from load_tests.prompts import code_prompts, grounded_prompts

_MAX_UNKNOWN_FRACTION = 0.5


@dataclass(frozen=True)
class PromptSet:
    """Prompts as token ids, and where they come from."""

    kind: str  # "held_out_code", "grounded" or "random_ids"
    token_ids: list[list[int]]
    sources: list[str]  # file:line of each window (or "random:i")


PROMPT_SETS = ("code", "grounded")


def benchmark_prompt_sets(
    tokenizer: PreTrainedTokenizerBase, count: int, prompt_tokens: int, seed: int = 0, kind: str = "code"
) -> dict[str, PromptSet]:
    """`count` prompts each: the sets of PROMPT_SETS for a code pair, or held-out chat prompts for a chat pair
    (kind "chat"); the first set is the headline's."""
    if kind == "chat":
        return {"chat": chat_benchmark_prompts(tokenizer, count, seed)}
    return {
        "code": benchmark_prompts(tokenizer, count, prompt_tokens, seed),
        "grounded": grounded_benchmark_prompts(tokenizer, count, prompt_tokens, seed),
    }


def chat_benchmark_prompts(tokenizer: PreTrainedTokenizerBase, count: int, seed: int = 0) -> PromptSet:
    """`count` held-out chat prompts (load_tests/chat_prompts.py) rendered by the model's chat template, whole."""
    prompts = chat_prompts(count, seed=seed)
    token_ids = [
        list(tokenizer.apply_chat_template(chat_messages(p), add_generation_prompt=True, return_dict=True)["input_ids"])
        for p in prompts
    ]
    return PromptSet("held_out_chat", token_ids, [f"chat:{p.source}" for p in prompts])


def grounded_benchmark_prompts(
    tokenizer: PreTrainedTokenizerBase, count: int, prompt_tokens: int, seed: int = 0
) -> PromptSet:
    """`count` input-grounded prompts, whole (their lengths vary; `prompt_tokens` sizes the random fallback)."""
    prompts = grounded_prompts(count, seed=seed)
    token_ids = [tokenizer(p.prompt, add_special_tokens=False)["input_ids"] for p in prompts]
    total = sum(len(ids) for ids in token_ids)
    unknown = sum(i == tokenizer.unk_token_id for ids in token_ids for i in ids)
    if total and unknown / total <= _MAX_UNKNOWN_FRACTION:
        return PromptSet("grounded", token_ids, [p.source for p in prompts])
    return random_prompts(tokenizer, count, prompt_tokens, seed + 1)


def benchmark_prompts(tokenizer: PreTrainedTokenizerBase, count: int, prompt_tokens: int, seed: int = 0) -> PromptSet:
    """`count` prompts of exactly `prompt_tokens` tokens: the last tokens of held-out code windows."""
    windows = code_prompts(count * 4, seed=seed, min_chars=6 * prompt_tokens, max_chars=24 * prompt_tokens)
    token_ids, sources = [], []
    unknown, total = 0, 0
    for window in windows:
        ids = tokenizer(window.prompt, add_special_tokens=False)["input_ids"]
        unknown += sum(i == tokenizer.unk_token_id for i in ids)
        total += len(ids)
        if len(ids) >= prompt_tokens:
            token_ids.append(ids[-prompt_tokens:])
            sources.append(window.source)
        if len(token_ids) == count:
            break
    if total and unknown / total <= _MAX_UNKNOWN_FRACTION and len(token_ids) == count:
        return PromptSet("held_out_code", token_ids, sources)
    return random_prompts(tokenizer, count, prompt_tokens, seed)


def random_prompts(tokenizer: PreTrainedTokenizerBase, count: int, prompt_tokens: int, seed: int = 0) -> PromptSet:
    """Deterministic random ids that avoid special tokens (for tokenizers that cannot encode code)."""
    special = set(tokenizer.all_special_ids)
    allowed = [i for i in range(len(tokenizer)) if i not in special]
    rng = random.Random(seed)
    return PromptSet(
        "random_ids",
        [[rng.choice(allowed) for _ in range(prompt_tokens)] for _ in range(count)],
        [f"random:{i}" for i in range(count)],
    )
