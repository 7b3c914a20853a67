"""Distilling the draft: started from the target's bottom layers, trained on the target's own outputs.

- The draft shares the target's width, so it starts as the target cut to its first layers: the same token
  embeddings (tied to the output head), final norm and bottom decoder layers (as LayerSkip and layer-dropped
  drafts do). Distillation then teaches those few layers to finish the job the whole stack did.
- Loss at each continuation position of `TargetOutputs`: cross-entropy against the target's distribution
  coarsened to its top k tokens plus one bucket for the rest (so the draft's mass outside the top k stays
  the target's, which the rejection rule's acceptance needs), plus cross-entropy on the token the target
  wrote: weight 1 where it was sampled (an unbiased estimate of the full distribution's cross-entropy, tail
  included), 0.1 where it was the greedy argmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from demo_pair.target_outputs import TargetOutputs

SAMPLED_TOKEN_WEIGHT = 1.0
GREEDY_TOKEN_WEIGHT = 0.1


def draft_from_target(target: LlamaForCausalLM, config: LlamaConfig) -> LlamaForCausalLM:
    """A draft of `config`'s depth holding copies of the target's embeddings, output head, final norm and bottom
    layers."""
    if config.hidden_size != target.config.hidden_size:
        raise ValueError("the draft starts from the target's layers, so it needs the target's hidden size")
    draft = LlamaForCausalLM(config)
    draft.model.embed_tokens.load_state_dict(target.model.embed_tokens.state_dict())
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    draft.lm_head.load_state_dict(target.lm_head.state_dict())  # the embeddings again where tied
    for draft_layer, target_layer in zip(draft.model.layers, target.model.layers, strict=False):
        draft_layer.load_state_dict(target_layer.state_dict())
    return draft


def sequence_distillation_loss(outputs: TargetOutputs, batch_size: int):
    """A `BatchLoss` over random rows of the target's continuations (a group chosen by its share of rows)."""
    rows = torch.tensor([len(t) for t in outputs.tokens], dtype=torch.float)

    def loss(model: LlamaForCausalLM, generator: torch.Generator) -> torch.Tensor:
        group = int(torch.multinomial(rows, 1, generator=generator))
        picked = torch.randint(0, len(outputs.tokens[group]), (batch_size,), generator=generator)
        tokens = outputs.tokens[group][picked]  # [B, P + C]
        prompt_length = outputs.prompt_length[group]
        logits = model(input_ids=tokens[:, :-1]).logits[:, prompt_length - 1 :].float()  # [B, C, V]
        logp = F.log_softmax(logits, dim=-1)  # [B, C, V]
        teacher = outputs.top_logprobs[group][picked].float().exp()  # [B, C, K]
        teacher_rest = (1 - teacher.sum(-1)).clamp(min=0)  # [B, C]
        draft_top = logp.gather(-1, outputs.top_ids[group][picked].long())  # [B, C, K]
        draft_rest = torch.log1p(-draft_top.exp().sum(-1).clamp(max=1 - 1e-6))  # [B, C]
        soft = -(teacher * draft_top).sum(-1) - teacher_rest * draft_rest  # [B, C]
        hard = -logp.gather(-1, tokens[:, prompt_length:, None]).squeeze(-1)  # [B, C]
        sampled = outputs.sampled[group][picked]  # [B]
        hard_weight = torch.where(sampled, SAMPLED_TOKEN_WEIGHT, GREEDY_TOKEN_WEIGHT)[:, None]  # [B, 1]
        valid = outputs.valid[group][picked].float()  # [B, C]
        return ((soft + hard_weight * hard) * valid).sum() / valid.sum().clamp(min=1)

    return loss
