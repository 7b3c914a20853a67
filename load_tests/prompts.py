"""Prompt sets: held-out code, input-grounded rewrites, tokenizer-free words for tiny test models, and chat questions.

Every set is deterministic for a seed, so the speculative and the plain runs of a level send the same
prompts in the same order. Prompts are text (the coordinator tokenizes) except where noted.
"""

from __future__ import annotations

import random
import re
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from demo_pair.corpus import CorpusFile, load_split

_CODE_WORDS = re.compile(r"\b(def|class|return|if|for|while|import|with)\b")
_FUNCTION_START = re.compile(r"^(\s*)(async\s+)?def \w+\(")

# "Repeat the input" tasks: the answer re-types the quoted code, so a drafter that copies from the prompt
# (or a draft model that has learnt to copy) has its best case here.
GROUNDED_TEMPLATES = (
    "# Rewrite this function with type hints\n{code}\n# Rewritten:\n{first_line}\n",
    "# Copy this function exactly\n{code}\n# Copy:\n{first_line}\n",
    "# Rewrite this function with a docstring\n{code}\n# Rewritten:\n{first_line}\n",
    "# The same function, reformatted\n{code}\n# Reformatted:\n{first_line}\n",
)


@dataclass(frozen=True)
class Prompt:
    """One prompt of a set: text, or token ids for a pre-tokenized prompt."""

    set_name: str
    prompt: str | tuple[int, ...]
    source: str = ""  # where it was cut from (file:line), for reading the report

    @property
    def chars(self) -> int:
        return len(self.prompt) if isinstance(self.prompt, str) else 0


@lru_cache(maxsize=1)
def held_out_files() -> tuple[CorpusFile, ...]:
    """The demo corpus's held-out files, read once per process."""
    return tuple(load_split(held_out=True))


def code_prompts(
    count: int, seed: int = 0, min_chars: int = 200, max_chars: int = 600, files: Sequence[CorpusFile] | None = None
) -> list[Prompt]:
    """Windows of held-out stdlib source that end at a line break plus the next line's indentation, so the
    completion continues real code. Windows without code keywords (data tables) are skipped."""
    files = [f for f in (files if files is not None else held_out_files()) if len(f.text) > max_chars]
    if not files:
        raise ValueError("no held-out corpus file is long enough for a code prompt")
    rng = random.Random(seed)
    prompts: list[Prompt] = []
    for _ in range(count * 50):
        if len(prompts) == count:
            break
        corpus_file = rng.choice(files)
        lines = corpus_file.text.splitlines(keepends=True)
        first = rng.randrange(len(lines))
        window, last = "", first
        while last < len(lines) and len(window) < min_chars:
            window += lines[last]
            last += 1
        if not min_chars <= len(window) <= max_chars or last >= len(lines) or not _CODE_WORDS.search(window):
            continue
        next_line = lines[last]
        indent = next_line[: len(next_line) - len(next_line.lstrip(" \t"))]
        prompts.append(Prompt("code", window + indent, f"{corpus_file.relative_path}:{first + 1}"))
    if len(prompts) < count:
        raise ValueError(f"found only {len(prompts)} of {count} code prompts")
    return prompts


def _functions(corpus_file: CorpusFile, min_lines: int, max_lines: int, max_chars: int) -> list[tuple[int, str]]:
    """(line number, dedented source) of every function of a file whose length is within the bounds."""
    lines = corpus_file.text.splitlines()
    found = []
    for start, line in enumerate(lines):
        match = _FUNCTION_START.match(line)
        if not match:
            continue
        indent = len(match.group(1))
        end = start + 1
        while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent):
            end += 1
        while end > start + 1 and not lines[end - 1].strip():
            end -= 1
        body = textwrap.dedent("\n".join(lines[start:end]))
        if min_lines <= end - start <= max_lines and len(body) <= max_chars:
            found.append((start + 1, body))
    return found


def grounded_prompts(
    count: int,
    seed: int = 0,
    min_lines: int = 4,
    max_lines: int = 20,
    max_chars: int = 900,
    files: Sequence[CorpusFile] | None = None,
) -> list[Prompt]:
    """Prompts that quote a held-out function and ask for it back (copied, rewritten, reformatted), ending
    with the function's first line so the completion starts re-typing the quoted code."""
    files = files if files is not None else held_out_files()
    candidates = [
        (f.relative_path, number, body)
        for f in files
        for number, body in _functions(f, min_lines, max_lines, max_chars)
    ]
    if not candidates:
        raise ValueError("no held-out function fits the grounded prompt bounds")
    rng = random.Random(seed)
    chosen = rng.sample(candidates, count) if count <= len(candidates) else rng.choices(candidates, k=count)
    prompts = []
    for i, (path, number, body) in enumerate(chosen):
        template = GROUNDED_TEMPLATES[i % len(GROUNDED_TEMPLATES)]
        prompts.append(
            Prompt("grounded", template.format(code=body, first_line=body.splitlines()[0]), f"{path}:{number}")
        )
    return prompts


def word_prompts(
    count: int, seed: int = 0, vocab_size: int = 64, min_words: int = 3, max_words: int = 10
) -> list[Prompt]:
    """'w5 w17 w3 ...' prompts for the word-level tokenizer of the tiny test models (ids 1..vocab_size-1)."""
    rng = random.Random(seed)
    return [
        Prompt(
            "words",
            " ".join(f"w{rng.randrange(1, vocab_size)}" for _ in range(rng.randint(min_words, max_words))),
            f"words:{i}",
        )
        for i in range(count)
    ]


def chat_prompt_set(count: int, seed: int = 0) -> list[Prompt]:
    """Held-out chat questions for a chat model, sent as `messages` (load_tests/chat_prompts.py)."""
    from load_tests.chat_prompts import chat_prompts  # it builds on this module's Prompt

    return chat_prompts(count, seed=seed)


PROMPT_SETS: dict[str, Callable[..., list[Prompt]]] = {
    "code": code_prompts,
    "grounded": grounded_prompts,
    "words": word_prompts,
    "chat": chat_prompt_set,
}


def load_prompt_set(name: str, count: int, seed: int = 0) -> list[Prompt]:
    """`count` prompts of the named set (see PROMPT_SETS)."""
    if name not in PROMPT_SETS:
        raise ValueError(f"unknown prompt set {name!r}; choose from {', '.join(PROMPT_SETS)}")
    return PROMPT_SETS[name](count, seed=seed)
