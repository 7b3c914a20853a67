"""A target whose step is as short as an accelerator's, and a draft that agrees with it often: the fast pair.

On this CPU the demo target takes ~15 ms a step, where the serving path's own cost per round is a few percent.
The fast pair's target takes ~2 ms (the order of a 1-3B model's step on one H100), so the serving path weighs as
it would on a GPU. Random weights, built from a config in a second, with the demo tokenizer (the load tests'
prompt sets encode with it):
- target: a Llama of `layers` layers whose layers past the first write only `residual_scale` of their output
  into the residual stream (their o_proj and down_proj scaled), so they cost a full layer each but move the logits
  little;
- draft: the target's embedding, first layer, norm and LM head, nothing else. It predicts the target's argmax as
  often as the later layers leave it alone: greedy α ~0.75 at the default scale, c = draft step / target step ~0.2.
Random weights spread wide (init range 0.4) give greedy decoding no near-ties and no short cycles.
"""

from __future__ import annotations

import pathlib
from dataclasses import asdict, dataclass

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from specdec.engine.embedded_pair import DEMO_TARGET_DIR


@dataclass(frozen=True)
class FastPairShape:
    """The target's sizes and how little its later layers move the logits (which sets α)."""

    hidden: int = 192
    intermediate: int = 512
    layers: int = 8
    heads: int = 4
    residual_scale: float = 0.02
    init_range: float = 0.4
    seed: int = 1

    def config(self, layers: int) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=8192,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.heads,
            max_position_embeddings=2048,
            initializer_range=self.init_range,
            bos_token_id=0,  # the demo tokenizer's
            eos_token_id=0,
            tie_word_embeddings=False,
        )


def build_fast_pair(root: pathlib.Path, shape: FastPairShape = FastPairShape()) -> tuple[pathlib.Path, pathlib.Path]:
    """Saves the fast target and its draft under root (target/, draft/) with the demo tokenizer; the same shape
    gives the same weights. Returns (target_dir, draft_dir)."""
    torch.manual_seed(shape.seed)
    target = LlamaForCausalLM(shape.config(shape.layers)).eval()
    with torch.no_grad():
        for layer in target.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(shape.residual_scale)
            layer.mlp.down_proj.weight.mul_(shape.residual_scale)
    draft = LlamaForCausalLM(shape.config(1)).eval()
    kept = {name: w for name, w in target.state_dict().items() if not name.startswith("model.layers.")}
    kept |= {name: w for name, w in target.state_dict().items() if name.startswith("model.layers.0.")}
    draft.load_state_dict(kept)
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TARGET_DIR)
    directories = root / "target", root / "draft"
    for model, directory in zip((target, draft), directories):
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    return directories


def describe(shape: FastPairShape) -> dict:
    """The shape for a report, with the parameter counts."""
    with torch.device("meta"):  # shapes only
        target, draft = LlamaForCausalLM(shape.config(shape.layers)), LlamaForCausalLM(shape.config(1))
    return {
        **asdict(shape),
        "target_parameters": sum(p.numel() for p in target.parameters()),
        "draft_parameters": sum(p.numel() for p in draft.parameters()),
    }
