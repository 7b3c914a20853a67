"""Tiny Llama target/draft pairs built from a config inside the tests (no downloads), saved as HF directories."""

from __future__ import annotations

import pathlib

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

EOS_TOKEN = "<eos>"
# Each message as "w<role> content", then "w3" opening the assistant's reply; other roles are refused.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] not in ('system', 'user', 'assistant') %}"
    "{{ raise_exception('unknown role ' + m['role']) }}"
    "{% endif %}"
    "{{ {'system': 'w1', 'user': 'w2', 'assistant': 'w3'}[m['role']] }} {{ m['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}w3{% endif %}"
)


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over '<eos>', 'w1', ..., 'w{V-1}' (id 0 is EOS)."""
    vocab = {EOS_TOKEN: 0, **{f"w{i}": i for i in range(1, vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=EOS_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, pad_token=EOS_TOKEN
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_llama(
    vocab_size: int, hidden: int, layers: int, seed: int, eos_boost: float = 1.0, init_range: float = 0.4
) -> LlamaForCausalLM:
    """A random Llama with logits spread wide enough that greedy argmax has no near-ties."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=2 * hidden,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=init_range,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight[0] *= eos_boost
    return model


def save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, directory: pathlib.Path) -> pathlib.Path:
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def noisy_copy(model: LlamaForCausalLM, noise: float, seed: int) -> LlamaForCausalLM:
    """The same architecture and weights plus Gaussian noise: a draft that agrees often but not always."""
    copy = LlamaForCausalLM(model.config).eval()
    copy.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in copy.parameters():
            parameter.add_(noise * parameter.std() * torch.randn(parameter.shape, generator=generator))
    return copy


def make_pair(
    root: pathlib.Path, vocab_size: int = 64, hidden: int = 32, noise: float = 0.3, eos_boost: float = 1.0
) -> tuple[pathlib.Path, pathlib.Path]:
    """Saves a tiny target and a noisy-copy draft sharing one tokenizer; returns (target_dir, draft_dir)."""
    tokenizer = word_tokenizer(vocab_size)
    target = tiny_llama(vocab_size, hidden, layers=2, seed=1, eos_boost=eos_boost)
    draft = noisy_copy(target, noise, seed=2)
    return save(target, tokenizer, root / "target"), save(draft, tokenizer, root / "draft")
