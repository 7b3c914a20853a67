"""Log-probabilities of committed tokens under the target: the log-softmax of its raw logits (docs/architecture.md,
"Log-probabilities").

They describe the target's own distribution before penalties, a constraint's mask, min_p, temperature, top-k and
top-p, as vLLM's default `raw_logprobs` mode does, so a token's figure depends on the prompt and the tokens before
it alone: the same whether it was drafted and accepted, recovered, drawn as a bonus or decoded plainly, and defined
under greedy decoding too (where the processed distribution is one-hot).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20  # alternatives a position may ask for (OpenAI's and vLLM's default limit)


@dataclass(frozen=True)
class TokenLogprob:
    """One committed token's log-probability and the most likely tokens at its position, most likely first."""

    token: int
    logprob: float
    top_tokens: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


def committed_logprobs(
    logits: Sequence[torch.Tensor], tokens: Sequence[Sequence[int]], top: Sequence[int]
) -> list[list[TokenLogprob]]:
    """Per round r: the TokenLogprob of each of tokens[r] (n_r ids) from its logit rows logits[r] [>= n_r, V] (row i
    holds the distribution token i was committed from), with top[r] alternatives each. One read of the device for
    every round together."""
    counts = [len(ids) for ids in tokens]
    if not sum(counts):
        return [[] for _ in tokens]
    rows = torch.cat([row_logits[:n] for row_logits, n in zip(logits, counts)]).float()  # [N, V]
    logprobs = torch.log_softmax(rows, dim=-1)  # [N, V]
    ids = torch.tensor([t for ids in tokens for t in ids], dtype=torch.long).to(rows.device, non_blocking=True)
    chosen = logprobs.gather(1, ids.unsqueeze(1)).squeeze(1)  # [N]
    width = min(max(top), logprobs.shape[1])
    top_values, top_ids = logprobs.topk(width, dim=-1) if width else (logprobs[:, :0], logprobs[:, :0].long())
    # float64 holds every id exactly (< 2**53), so values and ids come back in one read: [N * (1 + 2 * width)]
    host = torch.cat([chosen.double(), top_values.double().flatten(), top_ids.double().flatten()]).tolist()
    total = len(ids)
    values, alternatives = host[total : total + total * width], host[total + total * width :]
    result, at = [], 0
    for ids_r, top_r in zip(tokens, top):
        round_logprobs = []
        for token in ids_r:
            start = at * width
            round_logprobs.append(
                TokenLogprob(
                    token,
                    host[at],
                    tuple(int(t) for t in alternatives[start : start + top_r]),
                    tuple(values[start : start + top_r]),
                )
            )
            at += 1
        result.append(round_logprobs)
    return result
