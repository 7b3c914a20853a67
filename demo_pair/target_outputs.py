"""The target's own continuations of training-split prompts, with its top-k next-token log-probabilities.

The draft's job is to predict what the target writes next, so it is distilled on text the target wrote
(sequence-level distillation) against the target's distribution at each of those positions (token-level).
Prompts are random windows of the training split; most continuations are greedy, the rest sampled at
temperature 1, so both decoding modes the stack serves are covered. Saved in the work dir and reused.
"""

from __future__ import annotations

import pathlib
import time
from dataclasses import dataclass

import torch
from transformers import LlamaForCausalLM

PROMPT_LENGTHS = (32, 64, 96, 128)
TOP_K = 32


@dataclass(frozen=True)
class TargetOutputs:
    """Continuations of one shape-grouped set of prompts.

    - tokens: [N, P + C] prompt then continuation, per group of equal prompt length P
    - top_logprobs / top_ids: [N, C, K] the target's top-k log-probabilities at each continuation position
    - valid: [N, C] False after the continuation's end of text
    - sampled: [N] True where the continuation was sampled at temperature 1, False where greedy
    """

    prompt_length: list[int]
    tokens: list[torch.Tensor]
    top_logprobs: list[torch.Tensor]
    top_ids: list[torch.Tensor]
    valid: list[torch.Tensor]
    sampled: list[torch.Tensor]

    def continuation_tokens(self) -> int:
        return sum(int(v.sum()) for v in self.valid)


@torch.no_grad()
def continue_batch(
    target: LlamaForCausalLM, prompts: torch.Tensor, new_tokens: int, greedy: bool, eos_id: int
) -> tuple[torch.Tensor, ...]:
    """One batch of equal-length prompts [B, P] continued by the target: tokens, top-k, validity, sampled."""
    sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    out = target.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        eos_token_id=None,
        pad_token_id=eos_id,
        output_logits=True,
        return_dict_in_generate=True,
        **sampling,
    )
    logits = torch.stack(out.logits, dim=1).float()  # [B, C, V]
    top = torch.log_softmax(logits, dim=-1).topk(TOP_K, dim=-1)
    continuation = out.sequences[:, prompts.shape[1] :]  # [B, C]
    is_eos = (continuation == eos_id).long()  # [B, C]
    valid = is_eos.cumsum(dim=1) - is_eos == 0  # [B, C]: no end of text before this position
    sampled = torch.full((len(prompts),), not greedy)
    return out.sequences, top.values.half(), top.indices.short(), valid, sampled


def generate_target_outputs(
    target: LlamaForCausalLM,
    train_stream: torch.Tensor,
    batches: int,
    batch_size: int,
    new_tokens: int,
    eos_id: int,
    seed: int,
    cache_path: pathlib.Path,
) -> TargetOutputs:
    """`batches` batches of target continuations (two greedy to one sampled), cached at cache_path."""
    if cache_path.exists():
        return TargetOutputs(**torch.load(cache_path, weights_only=False))
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    groups: dict[int, list[tuple[torch.Tensor, ...]]] = {p: [] for p in PROMPT_LENGTHS}
    started = time.time()
    for index in range(batches):
        prompt_length = PROMPT_LENGTHS[index % len(PROMPT_LENGTHS)]
        starts = torch.randint(0, len(train_stream) - prompt_length, (batch_size,), generator=generator).tolist()
        prompts = torch.stack([train_stream[s : s + prompt_length] for s in starts])  # [B, P]
        groups[prompt_length].append(continue_batch(target, prompts, new_tokens, index % 3 != 2, eos_id))
        spent = time.time() - started
        print(
            f"[target outputs] batch {index + 1}/{batches} "
            f"eta {(batches - index - 1) * spent / (index + 1) / 60:.1f} min",
            flush=True,
        )
    kept = [p for p in PROMPT_LENGTHS if groups[p]]
    fields = {
        "prompt_length": kept,
        **{
            name: [torch.cat([batch[i] for batch in groups[p]]) for p in kept]
            for i, name in enumerate(("tokens", "top_logprobs", "top_ids", "valid", "sampled"))
        },
    }
    torch.save(fields, cache_path)
    return TargetOutputs(**fields)
