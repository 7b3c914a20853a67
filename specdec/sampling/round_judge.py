"""Judging many verification rounds at once on the logits' device, with one read back for them all.

`judge_rounds` gives every round exactly the Verdict that specdec/sampling/rules.py's `sample_verdict` gives it one at a
time (greedy, the rejection rule with q or a one-hot q, the coupled rule), each round with its own settings. The
host checks what it knows (shapes, token ids, positions) and makes the uniforms and the coupled rule's noise keys,
which are pure functions of seed and position; the device makes the noise from its keys and computes every row's
own target token and bad-logits code, and each rejection round's accepted count and draw, into one small tensor,
the only value read back; greedy and coupled rounds then accept on the host while their drafts match the targets.
(Exactly, that is, wherever torch sums a row of a batch as it sums the row alone, as on one CPU thread: a
residual's mass may otherwise differ in its last bit.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from specdec.common.host_copies import to_device
from specdec.sampling.row_sampling import (
    BAD_LOGITS_MESSAGES,
    BadLogits,
    RowSettings,
    batched_probs,
    host_uniforms,
    host_values,
    inverse_cdf,
    joined_rows,
)
from specdec.sampling.rules import (
    NonFiniteLogitsError,
    SamplingParams,
    Stream,
    Verdict,
    checked_round,
    coupled_scores,
    verdict_of_target_tokens,
)


@dataclass(frozen=True)
class DraftRound:
    """One round to judge: draft tokens x_1..x_γ, the q [γ, V] they were drawn from (None: one-hot; ignored under
    the coupled rule), the request's params, and the absolute position of x_1."""

    draft_tokens: Sequence[int]
    draft_probs: torch.Tensor | None
    params: SamplingParams
    start_position: int


def checked_tokens(round_: DraftRound, logits: torch.Tensor) -> list[int]:
    """The draft tokens as ints after sample_verdict's checks of the round against its logits [γ+1, V] on the host
    (ValueError), and what the batched judge needs besides: V >= 1 and positions that fit 64 bits."""
    params, start = round_.params, round_.start_position
    q = None if params.coupled else round_.draft_probs  # the coupled rule never reads q
    tokens = checked_round(round_.draft_tokens, q, logits, params, start)
    if logits.shape[1] == 0:
        raise ValueError(f"logits must have V >= 1 columns, got {list(logits.shape)}")
    if start >= 2**64 - len(tokens):
        raise ValueError(f"start_position must lie in [0, 2**64 - γ), got {start}")
    return tokens


def judge_rounds(rounds: Sequence[DraftRound], logits: Sequence[torch.Tensor]) -> list[Verdict | Exception]:
    """Per round its Verdict, or the error that fails it alone; logits[r] is round r's [γ_r+1, V] target rows, all on
    one device. Reads the device once, whatever the number of rounds (none when every round fails its checks)."""
    if len(rounds) != len(logits):
        raise ValueError(f"got {len(rounds)} rounds but {len(logits)} logits tensors")
    results: list[Verdict | Exception | None] = [None] * len(rounds)
    valid: list[tuple[int, list[int]]] = []  # (round index, its draft tokens)
    for index, (round_, round_logits) in enumerate(zip(rounds, logits)):
        try:
            tokens = checked_tokens(round_, round_logits)
            if valid and round_logits.shape[1] != (vocab := logits[valid[0][0]].shape[1]):
                raise ValueError(f"logits must have the step's V = {vocab} columns, got {list(round_logits.shape)}")
            valid.append((index, tokens))
        except Exception as error:  # noqa: BLE001 - fails that round alone
            results[index] = error
    if valid:
        step = _Step([rounds[i] for i, _ in valid], [t for _, t in valid], [logits[i] for i, _ in valid])
        for (index, _), (verdict, code) in zip(valid, step.outcomes()):
            bad = code != BadLogits.NONE
            results[index] = NonFiniteLogitsError(BAD_LOGITS_MESSAGES[BadLogits(code)]) if bad else verdict
    return results


def _round_code(row_codes: Sequence[int]) -> int:
    """A round's BadLogits from its rows': NaN or +inf in any row, else a row that allows no token, else NONE."""
    if BadLogits.NAN_OR_POSINF in row_codes:
        return BadLogits.NAN_OR_POSINF
    return BadLogits.ALL_NEGINF if BadLogits.ALL_NEGINF in row_codes else BadLogits.NONE


class _Step:
    """The checked rounds of a step on the device: rows [K] (round r's γ_r+1 logit rows from offsets[r]); the
    rejection rounds' draft slots [S, W] (W = γmax + 1; slots past a round's γ are padding, never accepted)."""

    def __init__(self, rounds: Sequence[DraftRound], drafts: Sequence[list[int]], logits: Sequence[torch.Tensor]):
        self.rounds, self.drafts, self.device = rounds, drafts, logits[0].device
        self.gammas = [len(tokens) for tokens in drafts]
        self.offsets = [sum(g + 1 for g in self.gammas[:r]) for r in range(len(rounds))]
        self.width = max(self.gammas) + 1
        row_params = [rd.params for rd, g in zip(rounds, self.gammas) for _ in range(g + 1)]
        rows = RowSettings.of(row_params, self.device)
        self.probs, self.first_argmax, self.codes = batched_probs(joined_rows(logits), rows)  # [K, V], [K], [K]
        self.rejection = [r for r, rd in enumerate(rounds) if not rd.params.greedy and not rd.params.coupled]

    def tensor(self, values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        """Host values as a tensor on the step's device."""
        return host_values(values, dtype, self.device)

    def outcomes(self) -> list[tuple[Verdict, int]]:
        """Per round its Verdict and BadLogits code (the verdict means nothing where the code is not NONE), from one
        read of the device: every row's own target token and code, and the rejection rounds' n and draws. Greedy
        and coupled rounds accept on the host, while the drafted tokens equal the target's own."""
        rows = len(self.first_argmax)
        columns = [self.target_tokens(), self.codes.long()]  # [K] each
        if self.rejection:
            n = self.rejection_accepts().long().cumprod(dim=1).sum(dim=1)  # [S]: leading accepts
            columns += [n, self.rejection_draws(n)]  # [S] each
        host = torch.cat(columns).tolist()  # the step's one read
        targets, codes, rejected = host[:rows], host[rows : 2 * rows], host[2 * rows :]
        judged = dict(zip(self.rejection, zip(rejected[: len(self.rejection)], rejected[len(self.rejection) :])))
        outcomes = []
        for r, (tokens, start) in enumerate(zip(self.drafts, self.offsets)):
            code = _round_code(codes[start : start + len(tokens) + 1])
            if r in judged:
                n, next_token = judged[r]
                outcomes.append((Verdict(tokens[:n], next_token, is_bonus=n == len(tokens)), code))
            else:
                outcomes.append((verdict_of_target_tokens(tokens, targets[start : start + len(tokens) + 1]), code))
        return outcomes

    def target_tokens(self) -> torch.Tensor:
        """The target's own token per row [K]: its first argmax, or argmax(p / e) on coupled rounds' rows."""
        coupled = [(r, i) for r, rd in enumerate(self.rounds) if rd.params.coupled for i in range(self.gammas[r] + 1)]
        if not coupled:
            return self.first_argmax
        draws = [(self.rounds[r].params.seed, self.rounds[r].start_position + i) for r, i in coupled]
        rows = self.tensor([self.offsets[r] + i for r, i in coupled])  # [C]
        return self.first_argmax.index_copy(0, rows, coupled_scores(self.probs[rows], draws).argmax(dim=-1))

    @cached_property
    def slots(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rejection rounds' slots: each slot's logit row [S, W], drafted token [S, W] (0 past γ), whether it
        holds a drafted token [S, W]."""
        gammas = [self.gammas[r] for r in self.rejection]
        offsets = [self.offsets[r] for r in self.rejection]
        drafts = [self.drafts[r] for r in self.rejection]
        rows = self.tensor([[o + min(i, g) for i in range(self.width)] for o, g in zip(offsets, gammas)])
        draft = self.tensor([t + [0] * (self.width - len(t)) for t in drafts])
        in_draft = self.tensor([[i < g for i in range(self.width)] for g in gammas], torch.bool)
        return rows, draft, in_draft

    @cached_property
    def drafted_q(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rejection rounds' given q rows [Q+1, V] (a last zero row stands for slots without one), each slot's
        row in them [S, W], and which rounds gave q [S]."""
        given = [self.rounds[r].draft_probs for r in self.rejection]
        dtype = torch.float32
        for q in given:
            dtype = torch.promote_types(dtype, q.dtype) if q is not None else dtype
        vocab, stacked, q_rows, start = self.probs.shape[1], [], [], 0
        for q, g in zip(given, (self.gammas[r] for r in self.rejection)):
            stacked += [to_device(q.to(dtype), self.device)] if q is not None else []
            q_rows.append([start + i if q is not None and i < g else -1 for i in range(self.width)])
            start += g if q is not None else 0
        q_all = torch.cat([*stacked, torch.zeros(1, vocab, dtype=dtype, device=self.device)])  # [Q+1, V]
        has_q = self.tensor([q is not None for q in given], torch.bool)  # [S]
        return q_all, self.tensor(q_rows) % q_all.shape[0], has_q

    def rejection_accepts(self) -> torch.Tensor:
        """Accept flags [S, W] of the rejection rounds: u_i < p_i(x_i) / q_i(x_i) in float64, as the per-round code
        compares Python floats; q_i(x_i) = 0 rejects, a one-hot q has q_i(x_i) = 1."""
        q_all, q_rows, has_q = self.drafted_q
        slot_rows, draft, in_draft = self.slots  # [S, W] each
        p_x = self.probs[slot_rows, draft].double()  # [S, W]
        q_x = torch.where(has_q.unsqueeze(1), q_all[q_rows, draft].double(), 1.0)  # [S, W]
        ratios = torch.where(q_x > 0, p_x / q_x, 0.0)  # [S, W]
        return (self.uniforms(Stream.ACCEPT) < ratios) & in_draft

    def rejection_draws(self, n: torch.Tensor) -> torch.Tensor:
        """The rejection rounds' next tokens [S]: from the residual norm(max(0, p_n - q_n)) (p_n renormalised when it
        has no mass) after a rejection, or from p_γ, drawn at position start + n from the RESAMPLE stream."""
        rejection = self.rejection
        all_accepted = n == self.tensor([self.gammas[r] for r in rejection])  # [S]
        p_n = self.probs[self.tensor([self.offsets[r] for r in rejection]) + n]  # [S, V]
        q_all, q_rows, has_q = self.drafted_q
        slot = n.unsqueeze(1)  # [S, 1]
        one_hot = torch.zeros_like(p_n).scatter_(1, self.slots[1].gather(1, slot), 1.0)  # [S, V]
        q_n = q_all[q_rows.gather(1, slot).squeeze(1)]  # [S, V]
        fallback = p_n / p_n.sum(dim=-1, keepdim=True)  # [S, V]

        def normalised_residual(q: torch.Tensor) -> torch.Tensor:
            residual = (p_n - q).clamp(min=0)  # [S, V], in the dtype p and q promote to
            mass = residual.sum(dim=-1, keepdim=True)  # [S, 1]
            return torch.where(mass > 0, residual / mass, fallback.to(residual.dtype))

        residual = normalised_residual(torch.where(has_q.unsqueeze(1), q_n.float(), one_hot))  # [S, V]
        if q_all.dtype == torch.float64:  # float64 q rows keep their precision, as in the per-round code
            wide = self.tensor(
                [(q := self.rounds[r].draft_probs) is not None and q.dtype == torch.float64 for r in rejection],
                torch.bool,
            )  # [S]
            residual = torch.where(wide.unsqueeze(1), normalised_residual(q_n), residual.double())
        next_probs = torch.where(all_accepted.unsqueeze(1), p_n.to(residual.dtype), residual)  # [S, V]
        return inverse_cdf(next_probs, self.uniforms(Stream.RESAMPLE).gather(1, slot).squeeze(1))

    def uniforms(self, stream: Stream) -> torch.Tensor:
        """The rejection rounds' uniforms [S, W] in `stream` at their slots' positions (padding repeats position γ)."""
        rounds, gammas = self.rounds, self.gammas
        draws = [
            (rounds[r].params.seed, rounds[r].start_position + min(i, gammas[r]), stream)
            for r in self.rejection
            for i in range(self.width)
        ]
        return host_uniforms(draws, self.device).view(len(self.rejection), self.width)
