"""The SmolLM2 draft: the target cut to its bottom layers, its head's ids, and its loss.

- Shape: the target's first few decoder layers, its final norm, and its token embeddings with the tied head
  (demo_pair/draft_distillation.py's start): the target's own geometry, which distillation teaches those few layers
  to use. The embeddings stay frozen and are not shipped: the draft borrows them from the target at load time
  (specdec/engine/borrowed_embeddings.py), so its weight file holds only its layers.
- Deepening: a trained draft grows by the target's next layers with their output projections zeroed, so the deeper
  draft starts out computing exactly what the trained one does and distillation goes on from there.
- Head: served over the HEAD_TOKENS ids the target's answers use most (specdec/engine/subset_head.py); training
  computes logits over those ids only, as serving does.
- Loss at each answer position: cross-entropy against the target's top-k distribution mapped onto the head's ids
  (mass on ids outside the head, or outside the top k, in one "rest" bucket), plus cross-entropy on the token the
  target wrote where the head holds it, weight 1 where sampled and 0.1 where greedy (as demo_pair's draft).
"""

from __future__ import annotations

import pathlib
from collections import Counter
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from demo_pair.draft_distillation import GREEDY_TOKEN_WEIGHT, SAMPLED_TOKEN_WEIGHT, draft_from_target
from smollm2_draft.chat_outputs import ChatAnswer

HEAD_TOKENS = 8192
DRAFT_LAYERS = 2


def layer_dropped_draft(target: LlamaForCausalLM, layers: int) -> LlamaForCausalLM:
    """A draft of the target's first `layers` layers, final norm and (frozen) embeddings with the tied head."""
    config = type(target.config).from_dict({**target.config.to_dict(), "num_hidden_layers": layers})
    draft = draft_from_target(target, config)
    draft.get_input_embeddings().weight.requires_grad_(False)
    return draft


def trained_draft(target: LlamaForCausalLM, draft_dir: pathlib.Path, layers: int) -> LlamaForCausalLM:
    """A saved draft of `layers` layers (weights without the embedding) on the target's embeddings, float32."""
    draft = layer_dropped_draft(target, layers)
    weights = {name: tensor.float() for name, tensor in load_file(draft_dir / "model.safetensors").items()}
    missing = draft.load_state_dict(weights, strict=False).missing_keys
    if set(missing) - {"model.embed_tokens.weight", "lm_head.weight"}:
        raise ValueError(f"{draft_dir} lacks {missing}: not a draft of {layers} layers")
    return draft


def deepened_draft(shallower: LlamaForCausalLM, target: LlamaForCausalLM, layers: int) -> LlamaForCausalLM:
    """`shallower` with the target's next layers appended up to `layers`, their attention output and MLP down
    projections zeroed: each new layer adds nothing to the residual stream until training moves those weights."""
    deeper = layer_dropped_draft(target, layers)
    deeper.load_state_dict(shallower.state_dict(), strict=False)  # its layers, final norm and head
    for layer in deeper.model.layers[shallower.config.num_hidden_layers :]:
        torch.nn.init.zeros_(layer.self_attn.o_proj.weight)
        torch.nn.init.zeros_(layer.mlp.down_proj.weight)
    return deeper


def head_token_ids(answers: Sequence[ChatAnswer], count: int, always: Sequence[int]) -> list[int]:
    """The `count` ids the target's answers use most (the `always` ids first), sorted."""
    frequency = Counter(token for answer in answers for token in answer.answer_ids)
    chosen = list(dict.fromkeys([*always, *(token for token, _ in frequency.most_common())]))[:count]
    return sorted(chosen)


def share_in_head(answers: Sequence[Sequence[int]], kept: Sequence[int]) -> float:
    """Share of the answers' tokens (each answer a list of ids) that the head holds."""
    kept_set = set(kept)
    tokens = [token for answer in answers for token in answer]
    return sum(token in kept_set for token in tokens) / max(1, len(tokens))


def distillation_loss(
    answers: Sequence[ChatAnswer], kept: Sequence[int], batch_size: int, pad_id: int, vocab_size: int
):
    """A `BatchLoss` (demo_pair/train.py) over random answers, right-padded into one batch."""
    kept_ids = torch.tensor(kept)
    position_of = torch.full((vocab_size,), -1, dtype=torch.long)
    position_of[kept_ids] = torch.arange(len(kept))  # id -> its column in the head, -1 outside

    def loss(model: LlamaForCausalLM, generator: torch.Generator) -> torch.Tensor:
        picked = [answers[i] for i in torch.randint(0, len(answers), (batch_size,), generator=generator).tolist()]
        length = max(len(a.prompt_ids) + len(a.answer_ids) for a in picked)
        tokens = torch.full((batch_size, length), pad_id)  # [B, T]
        for row, answer in enumerate(picked):
            sequence = answer.prompt_ids + answer.answer_ids
            tokens[row, : len(sequence)] = torch.tensor(sequence)
        hidden = model.model(input_ids=tokens).last_hidden_state  # [B, T, D]
        head = model.get_input_embeddings().weight[kept_ids]  # [K, D]
        total, count = hidden.new_zeros(()), 0
        for row, answer in enumerate(picked):
            start, answer_length = len(answer.prompt_ids) - 1, len(answer.answer_ids)
            logp = F.log_softmax(hidden[row, start : start + answer_length] @ head.T, dim=-1)  # [C, K]
            teacher_ids = position_of[answer.top_ids.long()]  # [C, k]
            teacher = answer.top_logprobs.float().exp() * (teacher_ids >= 0)  # [C, k]
            draft_top = logp.gather(-1, teacher_ids.clamp(min=0)) * (teacher_ids >= 0)  # [C, k]
            teacher_rest = (1 - teacher.sum(-1)).clamp(min=0)  # [C]
            draft_rest = torch.log1p(-(draft_top.exp() * (teacher_ids >= 0)).sum(-1).clamp(max=1 - 1e-6))  # [C]
            soft = -(teacher * draft_top).sum(-1) - teacher_rest * draft_rest  # [C]
            written = position_of[torch.tensor(answer.answer_ids)]  # [C]
            hard = -logp.gather(-1, written.clamp(min=0)[:, None]).squeeze(-1) * (written >= 0)  # [C]
            weight = SAMPLED_TOKEN_WEIGHT if answer.sampled else GREEDY_TOKEN_WEIGHT
            total = total + (soft + weight * hard).sum()
            count += answer_length
        return total / max(1, count)

    return loss
