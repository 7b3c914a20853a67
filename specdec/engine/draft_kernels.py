"""A CPU draft's pass in fewer and cheaper products: q/k/v and gate/up fused, every product in bfloat16.

A draft's pass is short and mostly fixed cost: on the demo draft (2 layers of width 256, a 256 -> 8192 head) each
linear call costs tens of µs however few rows it has, and the head is the largest product of the pass. Here:

- each decoder layer's q/k/v projections, and its gate/up projections, run as one product of the stacked weights
  (three calls, and two, become one each); the direct forward (specdec/engine/direct_forward.py) uses them;
- where the CPU has AMX or AVX-512 BF16, every product of the pass (the fused ones, the attention output and MLP
  down projections, the LM head) runs in bfloat16 on oneDNN: its weight read at half the bytes, its product on the
  matrix units, float32 in and out (docs/architecture.md, "Direct forward").

Both change the draft's logits (the fused products in the last bits, bfloat16 by ~1e-2): fine for a draft, whose
proposals every rule judges exactly whatever they are, never for a target, whose logits must be its own; only the
draft service turns this on (docs/architecture.md, "Direct forward").
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaForCausalLM, LlamaMLP

from specdec.engine.cpu_linears import OneDnnLinear, onednn_available

log = logging.getLogger(__name__)

QKV, GATE_UP = "fused_qkv", "fused_gate_up"  # the attributes the fused products sit in, on attention and MLP


class FusedLinear:
    """Bias-free or all-biased nn.Linear layers over one input as one product, on oneDNN (as the decoder's linears
    run, specdec/engine/cpu_linears.py).

    - the layers' weights are stacked into one tensor and each layer's parameter becomes a view of its rows, so the
      model holds them once, plus oneDNN's layout of the stack (serving weights do not change);
    - the layers themselves drop their own oneDNN copies: only calls through the modules use them, on the default
      kernel.
    """

    def __init__(self, layers: Sequence[nn.Linear], bf16: bool = False):
        self.weight = _stacked([layer.weight for layer in layers])  # [sum of out_features, in_features]
        self.stacked_bias = _stacked([layer.bias for layer in layers]) if layers[0].bias is not None else None
        self.sizes = [layer.out_features for layer in layers]
        self.use_dtype(torch.bfloat16 if bf16 else torch.float32)
        for layer in layers:
            if isinstance(layer, OneDnnLinear):
                layer.revert()

    def use_dtype(self, dtype: torch.dtype) -> None:
        """Computes the product in `dtype` (float32 in and out either way), from a copy of the stack in it."""
        self.dtype = dtype
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.to(dtype), None)
        self.bias = self.stacked_bias.to(dtype) if self.stacked_bias is not None else None

    def __call__(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """hidden [..., in_features] -> each layer's output [..., out_features_i] (views of one product)."""
        product = torch.ops.mkldnn._linear_pointwise(
            hidden.to(self.dtype), self.packed_weight, self.bias, "none", [], ""
        )
        return product.float().split(self.sizes, dim=-1)

    @staticmethod
    def fits(layers: Sequence[nn.Module]) -> bool:
        """CPU float32 nn.Linear layers (or their oneDNN subclass) over one input width, all biased or none."""
        return (
            all(isinstance(layer, nn.Linear) for layer in layers)
            and len({layer.in_features for layer in layers}) == 1
            and len({layer.bias is None for layer in layers}) == 1
            and all(layer.weight.device.type == "cpu" and layer.weight.dtype == torch.float32 for layer in layers)
        )


class Bf16Linear(OneDnnLinear):
    """An fp32 nn.Linear computed in bfloat16 by oneDNN from a bfloat16 copy of its weight in oneDNN's layout (in
    place of the float32 one); float32 in, float32 out. Parameters and state_dict stay those of the nn.Linear."""

    @classmethod
    def convert(cls, linear: nn.Linear) -> Bf16Linear:
        """Turns `linear` (an nn.Linear or OneDnnLinear; its weight may be tied to other modules) into a Bf16Linear."""
        if isinstance(linear, OneDnnLinear):
            linear.revert()  # its float32 copy
        linear.__class__ = cls
        linear.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach().bfloat16(), None)
        linear.bf16_bias = linear.bias.detach().bfloat16() if linear.bias is not None else None
        return linear

    def revert(self) -> None:
        """Turns this layer back into an nn.Linear, dropping its bfloat16 copies."""
        del self.packed_weight, self.bf16_bias
        self.__class__ = nn.Linear

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., in_features] -> float32 [..., out_features]."""
        product = torch.ops.mkldnn._linear_pointwise(
            hidden.bfloat16(), self.packed_weight, self.bf16_bias, "none", [], ""
        )
        return product.float()


def _stacked(parameters: Sequence[nn.Parameter]) -> torch.Tensor:
    """The parameters' values stacked along dim 0; each parameter becomes a view of its rows of the stack."""
    stacked = torch.cat([parameter.detach() for parameter in parameters])
    start = 0
    for parameter in parameters:
        parameter.data = stacked[start : start + parameter.shape[0]]
        start += parameter.shape[0]
    return stacked


def bf16_products_fast() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AMX or AVX-512 BF16); elsewhere oneDNN emulates it, slower
    than float32."""
    return torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()


def use_draft_kernels(model: nn.Module) -> int:
    """Gives a CPU float32 Llama draft fused q/k/v and gate/up products in each decoder layer and, where bfloat16
    is fast, every product of its pass in bfloat16; returns how many layers got fused products (0: another model,
    device or dtype, or no oneDNN: nothing changed)."""
    if not onednn_available() or type(model) is not LlamaForCausalLM:
        return 0
    bf16 = bf16_products_fast()
    fused = 0
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        if type(attention) is not LlamaAttention or type(mlp) is not LlamaMLP:
            continue
        qkv, gate_up = (attention.q_proj, attention.k_proj, attention.v_proj), (mlp.gate_proj, mlp.up_proj)
        if FusedLinear.fits(qkv) and FusedLinear.fits(gate_up):
            vars(attention)[QKV], vars(mlp)[GATE_UP] = FusedLinear(qkv, bf16), FusedLinear(gate_up, bf16)
            fused += 1
            for projection in (attention.o_proj, mlp.down_proj):
                if bf16 and FusedLinear.fits([projection]):
                    Bf16Linear.convert(projection)
    head = model.get_output_embeddings()
    bf16 = bf16 and fused > 0
    if bf16 and isinstance(head, nn.Linear):
        Bf16Linear.convert(head)
    log.info(
        "draft kernels: %d of %d decoder layers with fused q/k/v and gate/up products, products in %s",
        fused,
        len(model.model.layers),
        "bfloat16" if bf16 else "float32",
    )
    return fused


def runs_bf16_products(model: nn.Module) -> bool:
    """Whether a draft's decoder layers compute in bfloat16 (use_draft_kernels where bfloat16 is fast; Llama drafts
    only, so other families answer False)."""
    if type(model) is not LlamaForCausalLM:
        return False
    return any(isinstance(module, Bf16Linear) for layer in model.model.layers for module in layer.modules())


def use_float32_layer_products(model: nn.Module) -> None:
    """Turns a draft's decoder-layer products back to float32 on oneDNN (its LM head keeps its kernel)."""
    for layer in model.model.layers:
        for fused in (fused_projections(layer.self_attn, QKV), fused_projections(layer.mlp, GATE_UP)):
            if fused is not None:
                fused.use_dtype(torch.float32)
        for module in list(layer.modules()):
            if isinstance(module, Bf16Linear):
                module.revert()
                OneDnnLinear.convert(module)


def fused_projections(module: nn.Module, name: str) -> FusedLinear | None:
    """The fused product `name` (QKV or GATE_UP) a layer's attention or MLP holds, or None."""
    return vars(module).get(name)


def drop_draft_kernels(model: nn.Module) -> None:
    """Drops the fused products and turns bfloat16 layers back into nn.Linear ones (their copies of the weights
    cannot follow the parameters, e.g. to the meta device)."""
    for module in model.modules():
        vars(module).pop(QKV, None)
        vars(module).pop(GATE_UP, None)
        if isinstance(module, Bf16Linear):
            module.revert()
