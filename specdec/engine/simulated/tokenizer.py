"""The twin's tokenizer: a real one of the served vocabulary's size, so text prompts, stop strings and streaming work
as with a real model, and the coordinator checks the replicas' vocabularies as it always does.

It is the demo pair's byte-level BPE (8,192 ids, so code prompts tokenize as on the demo pair) with ids past it
named `<tN>` up to the served size, built with the `tokenizers` library and saved once per size in the twin's cache
(specdec/engine/simulated/twin_cache.py). A coordinator names it `--tokenizer sim:PROFILE[:VOCAB]`, the twin device's
string.
"""

from __future__ import annotations

import json
import pathlib

from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from specdec.engine.embedded_pair import DEMO_TARGET_DIR
from specdec.engine.simulated.profiles import is_simulated, parse_twin_device
from specdec.engine.simulated.twin_cache import cached_folder

EOS_TOKEN = "<|endoftext|>"  # the demo BPE's id 0
_VERSION = 1  # bump when the tokenizer built for a size changes


def filler_token(token_id: int) -> str:
    return f"<t{token_id}>"


def build_tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    """The demo BPE extended with `<tN>` ids up to `vocab` ids in all."""
    spec = json.loads((DEMO_TARGET_DIR / "tokenizer.json").read_text())
    ids = spec["model"]["vocab"]
    if vocab < len(ids):
        raise ValueError(f"a twin tokenizer holds at least the demo BPE's {len(ids)} ids, not {vocab}")
    ids.update({filler_token(token_id): token_id for token_id in range(len(ids), vocab)})
    if len(ids) != vocab:
        raise ValueError(f"filler names collide with the demo BPE's tokens ({len(ids)} ids for {vocab})")
    backend = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, pad_token=EOS_TOKEN
    )


def twin_tokenizer_dir(vocab: int) -> pathlib.Path:
    """The saved tokenizer of `vocab` ids (built on first use)."""
    return cached_folder(
        f"tokenizer-{vocab}-v{_VERSION}", lambda folder: build_tokenizer(vocab).save_pretrained(folder)
    )


def load_twin_tokenizer(vocab: int) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(twin_tokenizer_dir(vocab))


def tokenizer_source(name: str) -> str:
    """A coordinator's --tokenizer as AutoTokenizer takes it: a twin device string becomes its saved tokenizer's
    folder, anything else stays as given."""
    if not is_simulated(name):
        return name
    return str(twin_tokenizer_dir(parse_twin_device(name, "tokenizer").served_vocab))
