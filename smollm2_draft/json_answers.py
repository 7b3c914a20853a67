"""The target's answers to chat requests for JSON, written under the schema each request names.

A request asks the target to describe a training-side topic (load_tests/chat_prompts.py) as a JSON object whose
fields it lists in words; the answer is decoded under that schema (or as any JSON object) as the stack would
decode it (constrained_continuation.py says what is recorded). The schemas are random (random_schemas.py); the
subjects of `benchmarks.constrained`'s requests are not training-side topics.
"""

from __future__ import annotations

import json
import pathlib
import random
import time

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from load_tests.chat_prompts import GENERAL_TOPICS, MODULE_TOPICS, is_held_out
from smollm2_draft.chat_outputs import TOP_K, ChatAnswer, rendered_messages
from smollm2_draft.constrained_continuation import continue_under_constraints
from smollm2_draft.random_schemas import random_object_schema
from specdec.sampling.constraints import ConstraintCompiler, ConstraintKind, ConstraintSpec

ANY_OBJECT_SHARE = 0.2  # of requests for any JSON object rather than for the fields a schema lists


def field_words(key: str, schema: dict) -> str:
    """How a request names one field of the schema in words."""
    words = key.replace("_", " ")
    if "enum" in schema:
        return f"{words} ({' or '.join(schema['enum'])})"
    kind = schema.get("type")
    if kind == "boolean":
        return f"{words} (true or false)"
    if kind in ("integer", "number"):
        return f"{'an' if words[0] in 'aeiou' else 'a'} {words} number"
    if kind == "array":
        return f"up to {schema['maxItems']} {words}"
    if kind == "object":
        return f"{words}: " + " and ".join(field_words(k, v) for k, v in schema["properties"].items())
    return f"its {words}"


def json_request(topic: str, rng: random.Random) -> tuple[str, ConstraintSpec]:
    """A user message asking for `topic` as JSON, and the constraint its answer is written under."""
    if rng.random() < ANY_OBJECT_SHARE:
        any_object = ConstraintSpec(ConstraintKind.JSON_OBJECT)
        return f"Describe {topic} as a JSON object. Reply with the JSON only.", any_object
    schema = random_object_schema(rng)
    fields = ", ".join(field_words(key, value) for key, value in schema["properties"].items())
    message = f"Describe {topic} as a JSON object with {fields}. Reply with the JSON only."
    return message, ConstraintSpec(ConstraintKind.JSON_SCHEMA, json.dumps(schema))


def generate_json_answers(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    out_path: pathlib.Path,
    count: int,
    batch_size: int,
    new_tokens: int,
    seed: int,
) -> list[ChatAnswer]:
    """`count` answers (two batches in three greedy, one sampled at temperature 1), saved at out_path."""
    if out_path.exists():
        return load_json_answers(out_path)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    topics = [t for t in (*GENERAL_TOPICS, *MODULE_TOPICS) if not is_held_out(t)]
    requests = [json_request(rng.choice(topics), rng) for _ in range(count)]
    compiler = ConstraintCompiler(tokenizer, target.config.vocab_size, [tokenizer.eos_token_id])
    answers: list[ChatAnswer] = []
    started = time.time()
    for index, first in enumerate(range(0, count, batch_size)):
        chunk = requests[first : first + batch_size]
        prompts = rendered_messages(tokenizer, [message for message, _ in chunk])
        greedy = index % 3 != 2
        written = continue_under_constraints(
            target, compiler, prompts, [spec for _, spec in chunk], greedy, tokenizer.eos_token_id, new_tokens, TOP_K
        )
        for row, prompt in enumerate(prompts):
            length = int(written.valid[row].sum())
            answers.append(
                ChatAnswer(
                    prompt,
                    written.tokens[row, :length].tolist(),
                    written.top_logprobs[row, :length],
                    written.top_ids[row, :length].int(),
                    not greedy,
                )
            )
        print(
            f"[json answers] {len(answers)}/{count}, {(time.time() - started) / (index + 1):.0f}s a batch", flush=True
        )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(answers, out_path)
    return answers


def load_json_answers(path: pathlib.Path) -> list[ChatAnswer]:
    """The answers saved at path, none when there is no such file."""
    return torch.load(path, weights_only=False) if path.exists() else []
