"""A Llama model's packed forward as functional calls: transformers' operations, in its order, without its modules.

On a CPU, each decoder layer of a narrow model spends a good part of its time in a dozen module calls and wrappers
around a few small matrix products (the demo target ~0.08 ms of ~0.7 ms a layer). Here a packed pass calls the same
tensor operations on the same weights directly, so its logits equal the modules' bit for bit, and rotates queries
and keys together. Models it does not mirror exactly (another
architecture, a module replaced or hooked, e.g. by tensor parallelism) keep transformers' forward
(docs/architecture.md, "Direct forward").
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn.modules import module as module_globals
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaRMSNorm,
    rotate_half,
)

from specdec.engine.draft_kernels import GATE_UP, QKV, fused_projections

if TYPE_CHECKING:
    from specdec.engine.packed_step import PackedStep, StaticStep

AttentionFunction = Callable[..., tuple[torch.Tensor, None]]  # transformers' attention interface
_MIRRORED = {
    LlamaDecoderLayer: (LlamaAttention, LlamaMLP, LlamaRMSNorm),
}  # decoder layer class -> the classes of its parts this file mirrors
# model -> (its refusal, its submodules); never the model itself, which would keep the entry's key alive
_structure: weakref.WeakKeyDictionary[nn.Module, tuple[str | None, list[nn.Module]]] = weakref.WeakKeyDictionary()


def direct_forward_refusal(model: nn.Module) -> str | None:
    """Why `model`'s packed passes keep transformers' forward, or None: they run direct. Its classes and parameters
    are checked once per model; hooks at every pass (a hook added later, e.g. to inject a fault, must run)."""
    if model not in _structure:
        _structure[model] = (_structure_refusal(model), list(model.modules())[1:])
    refusal, submodules = _structure[model]
    if refusal is not None:
        return refusal
    if module_globals._global_forward_hooks or module_globals._global_forward_pre_hooks:
        return "global module hooks"
    if _hooked(model) or any(_hooked(module) for module in submodules):
        return "a module is hooked"
    return None


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _structure_refusal(model: nn.Module) -> str | None:
    if type(model) is not LlamaForCausalLM:
        return f"{type(model).__name__} is not mirrored"
    layers = model.model.layers
    if any(type(layer) not in _MIRRORED for layer in layers):
        return "a decoder layer of another class"
    for layer in layers:
        parts = (layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm)
        if any(type(part) not in _MIRRORED[type(layer)] for part in parts):
            return "a layer's attention, MLP or norm of another class"
    for name, module in model.named_modules():
        if "forward" in vars(module):
            return f"module {name} has its own forward"
    if any(type(param.data) is not torch.Tensor for param in model.parameters()):
        return "sharded parameters"
    return None


def _rms_norm(hidden: torch.Tensor, norm: LlamaRMSNorm) -> torch.Tensor:
    """LlamaRMSNorm.forward."""
    as_float = hidden.to(torch.float32)
    variance = as_float.pow(2).mean(-1, keepdim=True)
    return norm.weight * (as_float * torch.rsqrt(variance + norm.variance_epsilon)).to(hidden.dtype)


def _linear(hidden: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    return layer.forward(hidden)  # nn.Linear's, or a OneDnnLinear's (specdec/engine/cpu_linears.py); hooks are refused


def _attention(
    attn: LlamaAttention,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    attend: AttentionFunction,
    step: PackedStep | StaticStep,
) -> torch.Tensor:
    """LlamaAttention.forward with the attention function `attend`; hidden [1, T, E], cos/sin [1, 1, T, D] ->
    [1, T, E]."""
    tokens, head_dim = hidden.shape[1], attn.head_dim
    fused = fused_projections(attn, QKV)
    if fused is not None:  # a draft's one product (specdec/engine/draft_kernels.py)
        query, key, value = fused(hidden)  # [1, T, H * D], [1, T, H_kv * D] twice
    else:
        query, key, value = (_linear(hidden, proj) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    query = query.view(1, tokens, -1, head_dim).transpose(1, 2)  # [1, H, T, D]
    key = key.view(1, tokens, -1, head_dim).transpose(1, 2)  # [1, H_kv, T, D]
    value = value.view(1, tokens, -1, head_dim).transpose(1, 2)  # [1, H_kv, T, D]
    both = torch.cat((query, key), dim=1)  # [1, H + H_kv, T, D]: rotated together, element by element
    both = (both * cos) + (rotate_half(both) * sin)
    query, key = both.split((query.shape[1], key.shape[1]), dim=1)
    attended, _ = attend(attn, query, key, value, None, scaling=attn.scaling, packed_step=step)
    return _linear(attended.reshape(1, tokens, -1).contiguous(), attn.o_proj)  # [1, T, E]


def _mlp(mlp: LlamaMLP, hidden: torch.Tensor) -> torch.Tensor:
    """LlamaMLP.forward."""
    fused = fused_projections(mlp, GATE_UP)
    if fused is not None:  # a draft's one product (specdec/engine/draft_kernels.py)
        gate, up = fused(hidden)  # [1, T, I] each
    else:
        gate, up = _linear(hidden, mlp.gate_proj), _linear(hidden, mlp.up_proj)
    return _linear(mlp.act_fn(gate) * up, mlp.down_proj)


def direct_logits(
    model: LlamaForCausalLM,
    attend: AttentionFunction,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    step: PackedStep | StaticStep,
    logits_to_keep: torch.Tensor | int = 0,
) -> torch.Tensor:
    """LlamaForCausalLM over a step's tokens input_ids [T] at positions [T], attending with `attend` (packed
    attention, given the step); the logits [K, V] of the tokens logits_to_keep indexes (0: all T)."""
    inner = model.model
    hidden = inner.embed_tokens(input_ids.unsqueeze(0))  # [1, T, E]
    cos, sin = inner.rotary_emb(hidden, position_ids=positions.unsqueeze(0))  # [1, T, D] each
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [1, 1, T, D]
    for layer in inner.layers[: model.config.num_hidden_layers]:
        hidden = hidden + _attention(layer.self_attn, _rms_norm(hidden, layer.input_layernorm), cos, sin, attend, step)
        hidden = hidden + _mlp(layer.mlp, _rms_norm(hidden, layer.post_attention_layernorm))
    hidden = _rms_norm(hidden, inner.norm)
    kept = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    return model.lm_head(hidden[:, kept, :])[0]
