"""Random-weight Llama models for the GPU step benchmark, built on the device without initialisation cost.

The shapes are those of Llama-3.1-8B (target) and Llama-3.2-1B (draft); the dry run uses tiny ones. Weights
are drawn once on the device (normal, small std: no NaNs, no near-ties under greedy on the tiny shapes), so an
8B model costs one allocation and one fill instead of the CPU initialisation and a copy. Both models share a
word-level tokenizer over the whole vocabulary ('t0' ... 't{V-1}', id 0 the EOS), which their saved
directories carry for the services.

Imports only torch, transformers and tokenizers (which transformers needs).
"""

from __future__ import annotations

import pathlib
import time
from dataclasses import asdict, dataclass

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel, PreTrainedTokenizerFast
from transformers.initialization import no_init_weights

EOS_TOKEN = "t0"


@dataclass(frozen=True)
class LlamaShape:
    """The sizes that set a Llama's step cost, and the std its random weights are drawn with."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tie_embeddings: bool
    init_std: float
    max_positions: int = 2048

    def config(self) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            max_position_embeddings=self.max_positions,
            tie_word_embeddings=self.tie_embeddings,
            bos_token_id=0,
            eos_token_id=0,
        )

    def describe(self) -> dict:
        return asdict(self)


LLAMA_8B = LlamaShape("llama-3.1-8b-shape", 4096, 14336, 32, 32, 8, 128256, tie_embeddings=False, init_std=0.02)
LLAMA_1B = LlamaShape("llama-3.2-1b-shape", 2048, 8192, 16, 32, 8, 128256, tie_embeddings=True, init_std=0.02)
TINY_TARGET = LlamaShape("tiny-target", 64, 128, 2, 4, 2, 256, tie_embeddings=False, init_std=0.4, max_positions=256)
TINY_DRAFT = LlamaShape("tiny-draft", 32, 64, 1, 2, 1, 256, tie_embeddings=True, init_std=0.4, max_positions=256)


@torch.no_grad()
def build_random(shape: LlamaShape, device: torch.device, dtype: torch.dtype, seed: int) -> PreTrainedModel:
    """The model allocated on `device` with initialisation skipped, then filled there: matrices ~ N(0, std²),
    norm weights 1."""
    with device, no_init_weights():
        model = AutoModelForCausalLM.from_config(shape.config(), dtype=dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    for parameter in model.parameters():
        if parameter.dim() > 1:
            parameter.normal_(0.0, shape.init_std, generator=generator)
        else:
            parameter.fill_(1.0)
    return model.eval()


def weight_bytes(model: PreTrainedModel) -> int:
    """Bytes of the model's parameters (tied ones once): what one step must read from memory at least."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over 't0' (EOS), 't1', ..., 't{V-1}'."""
    vocab = {f"t{i}": i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=EOS_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, pad_token=EOS_TOKEN
    )


def save_model_dir(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, directory: pathlib.Path) -> float:
    """Writes an HF directory (safetensors) the services can load; returns the seconds it took."""
    started = time.perf_counter()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return time.perf_counter() - started
