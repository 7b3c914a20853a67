"""Speculative sampling: the accept/resample rule that keeps speculative decoding exact.

The draft proposes tokens x_1..x_γ, drawing each x_i from its distribution q_i; the target scores
them in one forward pass, which yields p_1..p_{γ+1}. The rule follows Leviathan et al. 2022, "Fast
Inference from Transformers via Speculative Decoding" (arXiv:2211.17192), and Chen et al. 2023,
"Accelerating Large Language Model Decoding with Speculative Sampling" (arXiv:2302.01318):

- accepted tokens: the longest prefix x_1..x_n in which every x_i passed u_i < p_i(x_i) / q_i(x_i);
- recovered token: after the first rejection (at i = n + 1), a token drawn from the residual
  norm(max(0, p_i - q_i)), emitted in place of x_i;
- bonus token: when all γ were accepted, a token drawn from p_{γ+1}.

A round thus commits n + 1 tokens, each distributed exactly as under the target alone. Greedy
decoding (temperature 0) is the deterministic special case: accept x_i while it equals argmax p_i,
then emit argmax p at the first mismatch (or as the bonus).

Randomness is counter-based: the draw for absolute sequence position t in a stream is a function
of a hash of (seed, t, stream), never of shared RNG state. Output is then a function of (prompt,
settings, seed) alone, whatever retries, rollbacks or discarded pre-drafts occurred, and the draft's
draws are independent of the verifier's.

That rule (SamplingRule.REJECTION) still lets the tokens depend on where blocks start and end: a position
drawn by the accept/recover draws in one run may be a bonus draw in another. The coupled rule
(SamplingRule.COUPLED) removes that: position t has Gumbel noise g_t in R^V, a function of (seed, t) alone
(g_t = -log e_t, with e_t the exponential noise of specdec/sampling/coupled_noise.py, made on the device of the
probabilities). The target's token there is y_t = argmax(log p_t + g_t) = argmax(p_t / e_t), which is
distributed as p_t (the Gumbel-max trick); the draft drafts x_t = argmax(log q_t + g_t) with the same noise
(coupled_scores), so it agrees with the target wherever q resembles p. The verifier accepts x_t while
x_t = y_t and emits y at the first mismatch (or y_{γ+1} as the bonus): every committed token is the plain
decoder's y_t, whatever the blocks, and q is never needed.
"""

from __future__ import annotations

import enum
import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.sampling.coupled_noise import exponential_noise
from specdec.sampling.token_logprobs import TokenLogprob

_U64_LIMIT = 2**64
MAX_REPETITION_PENALTY = 10.0
MAX_ADDITIVE_PENALTY = 2.0  # frequency and presence penalties, as OpenAI's API bounds them
_KEY_LAYOUT = struct.Struct("<QQQ")  # seed, position, stream


class SamplingRule(enum.Enum):
    """How a sampled request's draft is judged (greedy requests ignore it: argmax at every position)."""

    REJECTION = "rejection"  # accept x with probability min(1, p(x)/q(x)), recover from norm(max(0, p - q))
    COUPLED = "coupled"  # Gumbel-max coupling: accept x_t while it is the target's argmax(log p_t + g_t)


@dataclass(frozen=True)
class SamplingParams:
    """How logits become tokens; the draft and the target must use the same settings."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int = 0
    rule: SamplingRule = SamplingRule.REJECTION
    # Applied to the logits before the rest (specdec/sampling/penalties.py): 1, 0, 0, 0 = off.
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        """Some penalty applies (min_p aside)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def coupled(self) -> bool:
        """Sampled under the coupled rule (greedy is greedy under either rule)."""
        return self.rule is SamplingRule.COUPLED and not self.greedy

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < _U64_LIMIT:
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if not isinstance(self.rule, SamplingRule):
            raise ValueError(f"rule must be a SamplingRule, got {self.rule!r}")
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}] (1 = off), "
                f"got {self.repetition_penalty!r}"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            if not -MAX_ADDITIVE_PENALTY <= getattr(self, name) <= MAX_ADDITIVE_PENALTY:
                raise ValueError(
                    f"{name} must be in [-{MAX_ADDITIVE_PENALTY}, {MAX_ADDITIVE_PENALTY}] (0 = off), "
                    f"got {getattr(self, name)!r}"
                )
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")


class NonFiniteLogitsError(ValueError):
    """Logits contain NaN or +inf, or a row allows no token at all."""


def row_maxima(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of float logits [..., V]: (its largest logit, the first index holding it), each [...].

    The largest logit is finite exactly when the row holds no NaN (max propagates it) and no +inf and allows
    some token (not every logit -inf): one pass over the logits checks them and finds the greedy token.
    """
    return logits.max(dim=-1)


def _raise_for_bad_rows(logits: torch.Tensor) -> None:
    """Raises NonFiniteLogitsError for logits [..., V] with NaN or +inf, or a row that allows no token."""
    if (logits.isnan() | logits.isposinf()).any():
        raise NonFiniteLogitsError("logits contain NaN or +inf")
    if (logits == -math.inf).all(dim=-1).any():
        raise NonFiniteLogitsError("a row of logits is all -inf, so no token is possible")


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits [..., V] -> float32 probabilities [..., V]: temperature, then top-k, then top-p.

    Greedy params give a one-hot at the argmax (first index on ties). Masked tokens get exactly 0.
    Top-k keeps every token tied with the k-th largest logit; top-p keeps the smallest set of most
    likely tokens whose mass reaches top_p (always at least one). -inf logits are legal masks.
    """
    params.validate()
    if logits.ndim == 0 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have shape [..., V] with V >= 1, got {list(logits.shape)}")
    logits = logits.float()
    largest, first_largest = row_maxima(logits)  # [...] each
    if not largest.isfinite().all():
        _raise_for_bad_rows(logits)
    vocab = logits.shape[-1]
    if params.greedy:
        return F.one_hot(first_largest, vocab).float()

    # Shift the max to 0 first: a tiny temperature then sends the others to -inf instead of the max to +inf.
    logits = (logits - largest.unsqueeze(-1)) / params.temperature
    if 0 < params.top_k < vocab:
        kth_largest = logits.topk(params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth_largest, -math.inf)
    probs = logits.softmax(dim=-1)  # [..., V]
    if params.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)  # [..., V]
        mass_before = F.pad(sorted_probs.cumsum(dim=-1)[..., :-1], (1, 0))  # [..., V]
        drop_sorted = mass_before >= params.top_p  # [..., V]; the first token always stays
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # [..., V]
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


class Stream(enum.IntEnum):
    """Independent random streams, one draw per sequence position in each."""

    DRAFT = 0  # the draft sampling x_t from q_t
    ACCEPT = 1  # the verifier's uniform u_t for the accept test
    RESAMPLE = 2  # the verifier drawing a recovered or bonus token
    GUMBEL = 3  # the coupled rule's Gumbel noise g_t, shared by the draft and the target


def position_uniform(seed: int, position: int, stream: Stream) -> float:
    """The uniform draw in [0, 1) for absolute sequence `position` in `stream`.

    The top 53 bits of the position's hash: it never depends on earlier draws, nor on torch's RNG,
    so outputs stay the same across torch versions and devices.
    """
    return (_position_key(seed, position, stream) >> 11) * 2.0**-53


def position_generator(seed: int, position: int, stream: Stream) -> torch.Generator:
    """A fresh CPU generator seeded by the hash of (seed, position, stream).

    For torch sampling ops such as a batched torch.multinomial; this module uses position_uniform.
    """
    generator = torch.Generator()
    generator.manual_seed(_position_key(seed, position, stream))
    return generator


def _position_key(seed: int, position: int, stream: Stream) -> int:
    """A 64-bit hash of (seed, position, stream): the counter behind every draw."""
    if not 0 <= seed < _U64_LIMIT:
        raise ValueError(f"seed must be in [0, 2**64), got {seed!r}")
    if not 0 <= position < _U64_LIMIT:
        raise ValueError(f"position must be in [0, 2**64), got {position!r}")
    digest = hashlib.blake2b(_KEY_LAYOUT.pack(seed, position, stream), digest_size=8, person=b"specdec.pos").digest()
    return int.from_bytes(digest, "little")


def sample_token(probs: torch.Tensor, params: SamplingParams, position: int, stream: Stream = Stream.DRAFT) -> int:
    """Draw one token from probs [V] (non-negative, any positive sum) at sequence `position`.

    Greedy: argmax, no randomness. Otherwise inverse-CDF sampling: the position's uniform draw is
    located in the float64 cumulative sum of probs, on the CPU, so the token does not depend on the
    device holding probs and zero-probability tokens are never drawn.
    """
    if probs.ndim != 1 or probs.shape[0] == 0:
        raise ValueError(f"probs must have shape [V] with V >= 1, got {list(probs.shape)}")
    if params.greedy:
        return int(probs.argmax())
    cdf = probs.cpu().cumsum(dim=0, dtype=torch.float64)  # [V]
    total = cdf[-1].item()
    if not (math.isfinite(total) and total > 0):
        raise ValueError(f"probs must be finite with a positive sum, got sum {total}")
    point = position_uniform(params.seed, position, stream) * total
    token = int(torch.searchsorted(cdf, point, right=True))
    if token == cdf.shape[0]:  # point rounded up to total: take the last token with mass
        token = int(torch.searchsorted(cdf, total))
    return token


def coupled_scores(probs: torch.Tensor, draws: Sequence[tuple[int, int]]) -> torch.Tensor:
    """p / e, float32 [R, V], for probability rows [R, V] and each row's (seed, position): e is the position's
    exponential noise (specdec/sampling/coupled_noise.py), made on the rows' device from the hash of (seed, position,
    GUMBEL). argmax(p / e) = argmax(log p + g) with g = -log e Gumbel: the argmax of a row is a draw from it (the
    Gumbel-max trick), masked tokens (probability 0) score 0 and are never drawn, and its ranking is what the
    coupled rule guesses from."""
    if probs.ndim != 2 or probs.shape[1] == 0 or probs.shape[0] != len(draws):
        raise ValueError(f"probs must have shape [R, V] with V >= 1 and a row per draw, got {list(probs.shape)}")
    keys = [_position_key(seed, position, Stream.GUMBEL) for seed, position in draws]
    return probs.float() / exponential_noise(keys, probs.shape[1], probs.device)


def coupled_tokens(probs: torch.Tensor, params: SamplingParams, start_position: int) -> list[int]:
    """The coupled rule's token per probability row [R, V]: argmax(log p + g) at start_position + i; one
    transfer from the device for all rows."""
    draws = [(params.seed, start_position + i) for i in range(probs.shape[0])]
    return coupled_scores(probs, draws).argmax(dim=-1).tolist()


def plain_token(probs: torch.Tensor, params: SamplingParams, position: int) -> int:
    """The target's token at `position` when decoding alone (γ 0) from its probs [V], under the request's rule:
    argmax when greedy, argmax(log p + g) when coupled, else a RESAMPLE draw. A round with no draft emits it."""
    if params.coupled:
        return coupled_tokens(probs.unsqueeze(0), params, position)[0]
    return sample_token(probs, params, position, Stream.RESAMPLE)


@dataclass(frozen=True)
class Verdict:
    """The outcome of verifying one round of draft tokens."""

    accepted_tokens: list[int]  # the accepted prefix of the draft tokens
    next_token: int | None  # recovered token after a rejection, or bonus token; None: the constraint's dead end
    is_bonus: bool
    logprobs: tuple[TokenLogprob, ...] = ()  # of `tokens`, when the session asked for them (else empty)

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_tokens)

    @property
    def dead_end(self) -> bool:
        """The request's constraint allows no token after the accepted ones: the request ends with them."""
        return self.next_token is None

    @property
    def tokens(self) -> list[int]:
        """What this round commits: the accepted tokens, then the recovered or bonus token (none at a dead end)."""
        return [*self.accepted_tokens, *([] if self.next_token is None else [self.next_token])]


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) for p, q [V] -> [V].

    With no mass left (p == q up to rounding) this returns p renormalised: a rejection then has
    probability ~0 anyway, and the fallback keeps the recovered draw well-defined.
    """
    if p.ndim != 1 or p.shape != q.shape:
        raise ValueError(f"p and q must both be [V], got {list(p.shape)} and {list(q.shape)}")
    residual = (p - q).clamp(min=0)  # [V]
    mass = residual.sum().item()
    return residual / mass if mass > 0 else p / p.sum()


def acceptance_probability(p: torch.Tensor, q: torch.Tensor, token: int) -> float:
    """min(1, p(token) / q(token)) for p, q [V]; 0 where q(token) == 0, as in rejection_sample."""
    p_x, q_x = float(p[token]), float(q[token])
    return min(1.0, p_x / q_x) if q_x > 0 else 0.0


def rejection_sample(
    draft_tokens: Sequence[int],
    q: torch.Tensor | None,
    p: torch.Tensor,
    params: SamplingParams,
    start_position: int,
) -> Verdict:
    """Verify draft tokens x_1..x_γ against the target (rule and terms in the module docstring).

    Args:
        draft_tokens: x_1..x_γ. With γ = 0 this is a plain decode step: next_token ~ p[0].
        q: [γ, V] draft probabilities each x_i was drawn from, or None for a one-hot q (a
            model-free drafter such as n-gram lookup). Ignored when greedy.
        p: [γ+1, V] target probabilities, from logits_to_probs with the same params.
        params: sampling settings; greedy draws no random numbers.
        start_position: absolute sequence position of x_1. x_i sits at start_position + i - 1 and
            uses that position's ACCEPT and RESAMPLE draws; the bonus sits at start_position + γ.

    A token with q_i(x_i) == 0 is rejected. That cannot happen when x_i ~ q_i, so exactness is
    unaffected; rejecting avoids acting on an undefined ratio, and x_i keeps its target mass in the
    residual, from which the recovered token is drawn.
    """
    tokens = checked_round(draft_tokens, q, p, params, start_position)
    gamma, vocab = len(tokens), p.shape[1]
    n = 0  # number of accepted tokens
    if params.greedy:
        return verdict_of_target_tokens(tokens, p.argmax(dim=-1).tolist())

    x = torch.tensor(tokens, dtype=torch.long).view(gamma, 1).to(p.device)  # [γ, 1]
    p_x = p.gather(1, x).view(gamma).tolist()  # [γ]: p_i(x_i)
    if q is None:
        q_x = [1.0] * gamma  # a one-hot q
    else:
        q = q.to(p.device)
        q_x = q.gather(1, x).view(gamma).tolist()  # [γ]: q_i(x_i)
    # Python floats are float64, so p/q cannot overflow; min(1, .) is implied by u < 1.
    ratios = [p_i / q_i if q_i > 0 else 0.0 for p_i, q_i in zip(p_x, q_x)]  # q_i(x_i) = 0: reject
    seed = params.seed
    while n < gamma and position_uniform(seed, start_position + n, Stream.ACCEPT) < ratios[n]:
        n += 1

    if n == gamma:
        next_probs = p[gamma]  # [V]
    else:
        q_n = F.one_hot(x[n, 0], vocab).to(p.dtype) if q is None else q[n]  # [V]
        next_probs = residual_distribution(p[n], q_n)
    next_token = sample_token(next_probs, params, start_position + n, Stream.RESAMPLE)
    return Verdict(tokens[:n], next_token, is_bonus=n == gamma)


def coupled_sample(
    draft_tokens: Sequence[int], p: torch.Tensor, params: SamplingParams, start_position: int
) -> Verdict:
    """Verify draft tokens x_1..x_γ under the coupled rule (module docstring): with y_i = argmax(log p_i + g_i)
    at position start_position + i - 1, accept x_i while x_i = y_i, then emit y at the first mismatch, or
    y_{γ+1} as the bonus. Needs no q; p is [γ+1, V] from logits_to_probs. The committed tokens are the y's
    alone, so they equal plain coupled decoding's (plain_token) whatever the draft. Greedy params: argmax."""
    tokens = checked_round(draft_tokens, None, p, params, start_position)
    target_tokens = coupled_tokens(p, params, start_position) if not params.greedy else p.argmax(dim=-1).tolist()
    return verdict_of_target_tokens(tokens, target_tokens)


def verdict_of_target_tokens(tokens: Sequence[int], target_tokens: Sequence[int]) -> Verdict:
    """Accept the drafted tokens while they equal the target's own tokens [γ+1] of their positions, then emit the
    target's token (greedy, and the coupled rule)."""
    n = 0
    while n < len(tokens) and tokens[n] == target_tokens[n]:
        n += 1
    return Verdict(list(tokens[:n]), target_tokens[n], is_bonus=n == len(tokens))


def sample_verdict(
    draft_tokens: Sequence[int], q: torch.Tensor | None, p: torch.Tensor, params: SamplingParams, start_position: int
) -> Verdict:
    """The verdict on a draft under the request's rule (params.rule): coupled_sample, which ignores q, or
    rejection_sample. Greedy requests get the same verdict either way."""
    if params.coupled:
        return coupled_sample(draft_tokens, p, params, start_position)
    return rejection_sample(draft_tokens, q, p, params, start_position)


def checked_round(
    draft_tokens: Sequence[int], q: torch.Tensor | None, p: torch.Tensor, params: SamplingParams, start_position: int
) -> list[int]:
    """The draft tokens as ints, after checking the params and the shapes of a round (ValueError)."""
    params.validate()
    tokens = [int(t) for t in draft_tokens]
    gamma = len(tokens)
    if p.ndim != 2 or p.shape[0] != gamma + 1:
        raise ValueError(f"p must have shape [γ+1, V] = [{gamma + 1}, V], got {list(p.shape)}")
    vocab = p.shape[1]
    if q is not None and tuple(q.shape) != (gamma, vocab):
        raise ValueError(f"q must have shape [γ, V] = [{gamma}, {vocab}], got {list(q.shape)}")
    if any(not 0 <= t < vocab for t in tokens):
        raise ValueError(f"draft_tokens must lie in [0, {vocab}), got {tokens}")
    if start_position < 0:
        raise ValueError(f"start_position must be >= 0, got {start_position}")
    return tokens
