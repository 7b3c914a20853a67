"""What one sequence's request does to its logits before they are sampled: penalties, a constraint, min_p.

A sequence (a verifier's session, a drafter's lane) with such rules holds a `SequenceRules`. `shape` turns the rows
of a block into the logits the sampling rules then use (specdec/sampling/rules.py: temperature, top-k, top-p): the
penalties over each row's history, the constraint's mask after the drafted tokens before it, then min_p. The rules
read the sequence's own tokens each time, so a rollback (a shorter sequence) moves them with the KV cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.common.errors import InvalidFieldError
from specdec.sampling.constraints import (
    ConstraintCompiler,
    ConstraintCursor,
    ConstraintSpec,
    allowing_all,
    apply_bitmask,
)
from specdec.sampling.penalties import apply_min_p, penalise_block
from specdec.sampling.rules import SamplingParams


@dataclass(frozen=True)
class ShapedBlock:
    """A block's logits [n, V] after the rules, and the first row whose constraint allows no token (or None)."""

    logits: torch.Tensor
    dead_row: int | None = None


@dataclass
class SequenceRules:
    """The rules of one sequence: its params' penalties and min_p, and its constraint's cursor (None: none)."""

    params: SamplingParams
    output_start: int  # where the sequence's output begins: penalties and the constraint start there
    cursor: ConstraintCursor | None = None

    @staticmethod
    def applies(params: SamplingParams, cursor: ConstraintCursor | None) -> bool:
        """Whether such a sequence needs rules at all."""
        return cursor is not None or params.penalised or (params.min_p > 0 and not params.greedy)

    def fork(self) -> SequenceRules:
        """An independent copy (a new draft lane)."""
        return SequenceRules(self.params, self.output_start, self.cursor.fork() if self.cursor else None)

    def forced(self, tokens: Sequence[int], limit: int) -> list[tuple[int, list[int]]]:
        """Up to `limit` tokens the constraint decides after the sequence `tokens` (none without a constraint), each
        with the allowed tokens a target may write instead (ConstraintCursor.forced)."""
        if self.cursor is None or limit <= 0:
            return []
        return self.cursor.forced(tokens[self.output_start :], limit)

    def observe_committed(self, tokens: Sequence[int]) -> None:
        """Tells the constraint's spelling (specdec/sampling/spelled_text.py) that the sequence's first tokens are
        `tokens`, committed by the verifier."""
        if self.cursor is not None and self.cursor.spelling is not None:
            self.cursor.spelling.judge(tokens[self.output_start :])

    def shape(self, logits: torch.Tensor, tokens: Sequence[int], first: int) -> ShapedBlock:
        """The rules on a block's logits [n, V]: row j predicts position first + j, after tokens[:first + j] (the
        tokens past `first` are the block's drafted ones). A dead row's mask is left off: the caller ends there."""
        logits = penalise_block(logits, tokens, self.output_start, first, self.params)
        dead_row = None
        if self.cursor is not None:
            rows = logits.shape[0]
            mask, dead_row = self.cursor.block_mask(tokens[self.output_start : first], tokens[first:], rows)
            if dead_row is not None:
                mask[dead_row] = -1  # all allowed: the caller never samples it
            logits = logits.to(torch.float32, copy=True)  # masked in place
            apply_bitmask(logits, mask)
        return ShapedBlock(apply_min_p(logits, self.params), dead_row)


@dataclass(frozen=True)
class ShapedStep:
    """One step's logits [K, V] after each row's rules, and the rows that end there: None at a dead end (the
    constraint allows no token), else the error that failed that row alone."""

    logits: torch.Tensor
    ended: dict[int, Exception | None]


def shape_step(
    rules: Sequence[SequenceRules | None], logits: torch.Tensor, sequences: Sequence[Sequence[int]]
) -> ShapedStep:
    """The rules on one step's rows: row i of logits [K, V] predicts the token after sequences[i] under rules[i]
    (None: no rules). Penalties and min_p row by row where a row asks for them; the constraints' masks filled into
    one bitmask and applied to every row at once (docs/architecture.md, "Constrained and penalised decoding")."""
    logits = logits.to(torch.float32, copy=True)  # [K, V], masked in place
    mask, ended = None, {}
    for row, (rule, tokens) in enumerate(zip(rules, sequences)):
        if rule is None:
            continue
        try:
            if rule.params.penalised:
                logits[row] = penalise_block(
                    logits[row : row + 1], tokens, rule.output_start, len(tokens), rule.params
                )[0]
            if rule.cursor is not None:
                mask = allowing_all(len(rules), logits.shape[-1]) if mask is None else mask  # [K, ceil(V / 32)]
                if not rule.cursor.fill_row(mask, row, tokens[rule.output_start :]):
                    mask[row] = -1  # all allowed: the caller never samples it
                    ended[row] = None
        except Exception as error:  # noqa: BLE001 - the constraint engine failed that row alone
            ended[row] = error
    if mask is not None:
        apply_bitmask(logits, mask)
    for row, rule in enumerate(rules):
        if rule is not None and rule.params.min_p > 0 and row not in ended:
            logits[row] = apply_min_p(logits[row : row + 1], rule.params)[0]
    return ShapedStep(logits, ended)


def session_rules(
    compiler: ConstraintCompiler | None,
    params: SamplingParams,
    prompt_len: int,
    constraint: ConstraintSpec | None = None,
    output_start: int = 0,
) -> SequenceRules | None:
    """The rules of a session opened on a prompt of prompt_len tokens whose output begins at output_start (0: the
    prompt's end), or None when its request asks for none. A constraint is compiled by `compiler` (cached across
    requests; InvalidFieldError for a bad one); a compiler of None (a drafter without a tokenizer) leaves it off."""
    if not 0 <= output_start <= prompt_len:
        raise InvalidFieldError("output_start", f"{output_start} is outside the prompt [0, {prompt_len}]")
    cursor = compiler.cursor(constraint) if constraint is not None and compiler is not None else None
    if not SequenceRules.applies(params, cursor):
        return None
    return SequenceRules(params, output_start or prompt_len, cursor)
