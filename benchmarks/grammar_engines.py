"""Mask time per token of the grammar engines made for LLM decoding, on one tokenizer: how xgrammar was chosen.

    python -m benchmarks.grammar_engines models/demo-target     # or any tokenizer directory
    pip install llguidance==1.9.1 outlines-core==0.2.14         # the other two contenders (not project packages)

For each engine that is installed: compile one JSON schema, then over every token of a valid compact document
(its EOS included) fill the allowed-token mask and accept the token; the median over 5 passes of the time per
token, and the compile time. Engines missing are reported as such. Prints; writes nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import AutoTokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
        "score": {"type": "number"},
    },
    "required": ["name", "age", "tags", "address", "score"],
    "additionalProperties": False,
}
DOCUMENT = {
    "name": "Ada Lovelace the analyst",
    "age": 36,
    "tags": ["red", "blue"],
    "address": {"city": "London town", "zip": "12345"},
    "score": 3.25,
}
PASSES = 5


def per_token(step, tokens: list[int], fresh) -> float:
    """Median over passes of the seconds per token of step(state, token) from a fresh state each pass."""
    times = []
    for _ in range(PASSES):
        state = fresh()
        started = time.perf_counter()
        for token in tokens:
            step(state, token)
        times.append((time.perf_counter() - started) / len(tokens))
    return statistics.median(times)


def xgrammar_figures(tokenizer, tokens: list[int], eos: int) -> tuple[float, float]:
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer), stop_token_ids=[eos])
    started = time.perf_counter()
    compiled = xgrammar.GrammarCompiler(info, cache_enabled=False).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":")
    )
    compile_s = time.perf_counter() - started
    mask = xgrammar.allocate_token_bitmask(1, len(tokenizer))

    def step(matcher, token):
        matcher.fill_next_token_bitmask(mask)
        assert matcher.accept_token(token)

    return compile_s, per_token(step, tokens, lambda: xgrammar.GrammarMatcher(compiled))


def llguidance_figures(tokenizer, tokens: list[int], eos: int) -> tuple[float, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=eos)
    started = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
    llguidance.LLMatcher(lltokenizer, grammar)
    compile_s = time.perf_counter() - started
    mask = llguidance.torch.allocate_token_bitmask(1, len(tokenizer))

    def step(matcher, token):
        llguidance.torch.fill_next_token_bitmask(matcher, mask)
        assert matcher.consume_token(token)

    return compile_s, per_token(step, tokens, lambda: llguidance.LLMatcher(lltokenizer, grammar))


def outlines_core_figures(tokenizer, tokens: list[int], eos: int) -> tuple[float, float]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    started = time.perf_counter()
    vocabulary: dict[str, list[int]] = {}
    for piece, token in tokenizer.get_vocab().items():
        if token != eos:
            vocabulary.setdefault(tokenizer.convert_tokens_to_string([piece]), []).append(token)
    index = Index(build_regex_from_schema(json.dumps(SCHEMA)), Vocabulary(eos, vocabulary))
    compile_s = time.perf_counter() - started
    mask = torch.zeros(1, (len(tokenizer) + 31) // 32, dtype=torch.int32)

    def step(guide, token):
        guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
        guide.advance(token)

    return compile_s, per_token(step, tokens[:-1], lambda: Guide(index))  # its guide ends on the last character


ENGINES = {"xgrammar": xgrammar_figures, "llguidance": llguidance_figures, "outlines-core": outlines_core_figures}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tokenizer", help="a tokenizer directory (models/demo-target: 8,192 ids)")
    args = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    eos = tokenizer.eos_token_id
    tokens = tokenizer(json.dumps(DOCUMENT, separators=(",", ":")), add_special_tokens=False)["input_ids"] + [eos]
    print(f"vocabulary {len(tokenizer)} ids, document {len(tokens)} tokens")
    for name, figures in ENGINES.items():
        try:
            compile_s, token_s = figures(tokenizer, tokens, eos)
        except ImportError:
            print(f"{name:14s} not installed")
            continue
        print(f"{name:14s} compile {compile_s * 1e3:7.1f} ms, mask + accept {token_s * 1e6:6.1f} us a token")


if __name__ == "__main__":
    main()
