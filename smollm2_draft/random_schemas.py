"""Random JSON schemas for the draft's JSON training requests: objects of a few fields of every JSON type.

Key names and enum values come from pools that leave out those of `benchmarks.constrained`'s schema.
"""

from __future__ import annotations

import random

KEYS = (
    "title", "summary", "category", "year", "rating", "keywords", "location", "size", "difficulty", "popular",
    "author", "color", "price", "origin", "uses", "facts", "language", "country", "duration", "audience",
    "features", "platforms", "license", "status", "priority", "age", "weight", "height", "safe", "common",
    "examples", "related", "type", "kind", "score", "details", "source", "owner", "free", "online",
)  # fmt: skip
ENUMS = (
    ("fast", "slow"), ("on", "off"), ("read", "write", "append"), ("small", "medium", "large"), ("utf-8", "ascii"),
    ("info", "warning", "error"), ("left", "right", "center"), ("tcp", "udp"), ("auto", "always", "never"),
)  # fmt: skip


def random_value_schema(rng: random.Random, depth: int) -> dict:
    """A schema for one property: a string, number, boolean, enum, array of strings or (shallow) object."""
    kinds = ["string", "integer", "number", "boolean", "enum", "array"] + (["object"] if depth == 0 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.choice((8, 16, 24, 32))}
    if kind == "integer":
        return {"type": "integer", "minimum": 0, "maximum": rng.choice((9, 99, 999, 65535))}
    if kind == "enum":
        return {"enum": list(rng.choice(ENUMS))}
    if kind == "array":
        item = {"type": "string", "maxLength": rng.choice((8, 12, 16))}
        return {"type": "array", "items": item, "maxItems": rng.randint(2, 5)}
    if kind == "object":
        return random_object_schema(rng, depth + 1, rng.randint(1, 3))
    return {"type": kind}


def random_object_schema(rng: random.Random, depth: int = 0, size: int | None = None) -> dict:
    """An object of 2-5 (or `size`) properties with random keys and value schemas, most of them required."""
    chosen = rng.sample(KEYS, size or rng.randint(2, 5))
    properties = {key: random_value_schema(rng, depth) for key in chosen}
    required = [key for key in chosen if rng.random() < 0.8]
    return {"type": "object", "properties": properties, "required": required}
