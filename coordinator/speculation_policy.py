"""How many tokens to draft next: expected tokens per unit time, with costs measured under the current load.

A round that drafts γ tokens commits on average E(γ) = (1 - α^(γ+1)) / (1 - α) tokens (Leviathan et al.,
α = the request's acceptance rate) and costs γ batched draft passes plus one verify pass, plus the time each
call spends outside the services (wire, queueing, the coordinator's own work: W_d, W_v, measured per call).
With R sessions in the verifier's batch, each feeding γ+1 tokens, the verify pass costs V(R·(γ+1)), where V is
the verifier's measured pass cost (specdec/engine/step_cost.py); a draft pass over the drafter's R_d sessions costs
D(R_d). A block drafted afresh under load arrives while the verifier runs the other sessions' next pass and waits
for it: with R > 1 that adds (1 - 1/R)·(V - the draft time) when the pass is the longer. In overlapped mode the
rounds whose block was pre-drafted (the request's own pre-draft hit rate h) skip both, so they count (1 - h) times:
a request whose drafts the verifier seldom accepts, and whose verdicts are then seldom guessed, turns to plain
decoding sooner under load than one whose drafts land. γ = 0 is plain decoding through the verifier: E = 1 at cost
V(R) + W_v, with no drafter call. The policy picks, within [0, γ_max], the γ with the most tokens per unit time.
On an idle verifier the fixed cost of a pass dominates and speculation pays; as the batch grows the per-token
cost takes over, γ shrinks, and at some load plain decoding wins: speculation steps aside. Where that load lies
follows from the measurements.

What the pass costs do not show is measured too: each round's realized duration is compared with what the
model predicted for it (RoundTimes), separately for speculative and plain rounds, and each kind's ratio scales
its predictions (e.g. on shared hardware the drafter takes cores from the verifier).
A kind measured slower than the other is re-timed under the current conditions: once it has not been timed
for RECHECK_AFTER rounds of the other at a load, the next round there is of that kind, and a kind's new timing
weighs more the more rounds of the other kind came since its last one. Without it a kind timed while a queue
built up (or drained) kept that ratio, and the policy could stay with the other kind for good.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specdec.engine.step_cost import StepCost

MIN_TIMED_ROUNDS = 16  # rounds of a kind before its realized/predicted ratio is used
ROUND_TIME_SMOOTHING = 0.05  # weight of the newest round in the realized and predicted averages
PRIOR_JUDGED = 8  # a request's own counts outweigh the coordinator-wide α after this many judged draft tokens
INITIAL_ALPHA = 0.5  # before any round anywhere has been judged
ROWS_SMOOTHING = 0.2  # weight of the newest pass in the running batch-size average
RECHECK_AFTER = 16  # rounds of one kind at a load after which the other kind gets a round there, to re-time it
MAX_STALE_WEIGHT = 0.5  # most weight one round's timing gets in its kind's averages, however stale they are


def log2_level(count: float) -> int:
    """A count (sessions per pass, generations running) rounded on a log2 scale: 1 -> 0, 2 -> 1, 16 -> 4."""
    return max(0, round(math.log2(max(count, 1.0))))


def expected_tokens(alpha: float, gamma: int) -> float:
    """Mean tokens one round commits: accepted drafts plus the recovered or bonus token."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


@dataclass
class PassLoad:
    """One replica's measured pass cost and how many sessions its passes batch, refreshed by every reply."""

    cost: StepCost
    rows: float = 1.0
    call_overhead_ns: float = 0.0  # running average of a call's time outside the service

    def observe(self, tokens: int, ns: float, rows: int) -> None:
        """A pass that fed `tokens` tokens for `rows` sessions took `ns`."""
        self.cost.observe(tokens, ns)
        if rows > 0:
            self.rows += ROWS_SMOOTHING * (rows - self.rows)

    def observe_call(self, outside_ns: float) -> None:
        """A call to this replica spent `outside_ns` on the wire, queued, or in the coordinator."""
        self.call_overhead_ns += ROWS_SMOOTHING * (outside_ns - self.call_overhead_ns)

    def call_ns(self, tokens: float) -> float:
        """A call's predicted duration: one pass feeding `tokens` tokens, plus the time calls spend outside."""
        return self.cost.predict_ns(tokens) + self.call_overhead_ns


class AcceptanceRate:
    """The coordinator-wide α over recent rounds; the prior of every request's own estimate.

    α is counted over *judged* draft tokens (accepted ones plus the first rejected one of a round): the
    tokens after a rejection were never ruled on, so counting them would bias α low.
    """

    def __init__(self, smoothing: float = 0.02):
        self.value = INITIAL_ALPHA
        self._smoothing = smoothing

    def observe(self, judged: int, accepted: int) -> None:
        if judged:
            self.value += self._smoothing * (accepted / judged - self.value)

    def for_request(self, judged: int, accepted: int) -> float:
        """A request's α: its own counts, shrunk toward the coordinator-wide rate while they are few."""
        return (accepted + PRIOR_JUDGED * self.value) / (judged + PRIOR_JUDGED)


@dataclass
class TimedRounds:
    """Running averages of one kind of round's realized and predicted durations (ns), and how many were timed."""

    realized_ns: float = 0.0
    predicted_ns: float = 0.0
    rounds: int = 0


class RoundTimes:
    """Coordinator-wide running averages of realized and predicted round durations, per kind of round
    (speculative: a block of γ ≥ 1 drafted tokens; plain: γ = 0) and per load (the verifier's sessions per
    pass, on a log2 scale), and their ratio: what the pass costs miss grows with the load."""

    def __init__(self, smoothing: float = ROUND_TIME_SMOOTHING):
        self._smoothing = smoothing
        self._timed: dict[tuple[int, bool], TimedRounds] = {}  # (load level, speculative) -> its averages
        # (load level, speculative) -> rounds of the other kind timed there since this kind's last timing
        self._untimed_for: dict[tuple[int, bool], int] = {}
        self._rechecks: dict[tuple[int, bool], int] = {}  # re-timing rounds handed out: key -> its count then

    def observe(self, speculative: bool, rows: float, realized_ns: float, predicted_ns: float) -> None:
        """A round of that kind, with `rows` sessions per verify pass, took realized_ns where predicted_ns
        was predicted."""
        level = log2_level(rows)
        timed = self._timed.setdefault((level, speculative), TimedRounds())
        stale_for = self._untimed_for.pop((level, speculative), 0)
        self._rechecks.pop((level, speculative), None)
        self._untimed_for[(level, not speculative)] = self._untimed_for.get((level, not speculative), 0) + 1
        timed.rounds += 1
        # a plain mean while few, then a running average whose memory counts the rounds of both kinds
        weight = max(self._smoothing, 1.0 / timed.rounds, min(stale_for * self._smoothing, MAX_STALE_WEIGHT))
        timed.realized_ns += weight * (realized_ns - timed.realized_ns)
        timed.predicted_ns += weight * (predicted_ns - timed.predicted_ns)

    def claim_recheck(self, rows: float) -> bool | None:
        """The kind (speculative or not) due for a round at this load, or None: a kind measured slower than the
        other there and not timed for RECHECK_AFTER rounds of the other (its ratio may be stale). The caller runs
        one round of it; it is handed out once (again only if RECHECK_AFTER more rounds pass untimed)."""
        level = log2_level(rows)
        for speculative in (True, False):
            key = (level, speculative)
            stale_for = self._untimed_for.get(key, 0)
            if (
                stale_for >= RECHECK_AFTER
                and stale_for >= self._rechecks.get(key, -RECHECK_AFTER) + RECHECK_AFTER
                and self.slowdown(speculative, rows) > self.slowdown(not speculative, rows)
            ):
                self._rechecks[key] = stale_for
                return speculative
        return None

    def slowdown(self, speculative: bool, rows: float) -> float:
        """How much longer that kind's rounds take than predicted at that load (1 until enough were timed)."""
        timed = self._timed.get((log2_level(rows), speculative), TimedRounds())
        if timed.rounds < MIN_TIMED_ROUNDS or timed.predicted_ns <= 0:
            return 1.0
        return timed.realized_ns / timed.predicted_ns


def round_ns(gamma: int, verify: PassLoad, draft: PassLoad | None, predraft_hit_rate: float | None = None) -> float:
    """A round's predicted duration: a block of γ drafted tokens (0: a plain step) at the measured costs.

    predraft_hit_rate None: sequential rounds, every block drafted afresh (every other session's too, so the
    verifier's batch waits for drafts alike). A rate: overlapped rounds, where the rounds whose block was
    pre-drafted during the previous verification (that share of them) do not wait for the drafter, and the
    others pay the draft time and, under load, the pass the verifier runs meanwhile for the sessions whose
    blocks were pre-drafted.
    """
    rows = max(verify.rows, 1.0)
    verify_ns = verify.call_ns(rows * (gamma + 1))
    if gamma == 0 or draft is None:
        return verify_ns
    draft_ns = gamma * draft.cost.predict_ns(max(draft.rows, 1.0)) + draft.call_overhead_ns
    if predraft_hit_rate is None:
        return draft_ns + verify_ns
    # The others' pass starts as this request starts drafting (when the verifier batches others: a share
    # 1 - 1/rows of its pass); the fresh block waits for its end unless drafting takes longer.
    others_pass_ns = (1.0 - 1.0 / rows) * max(verify_ns - draft_ns, 0.0)
    return (1.0 - predraft_hit_rate) * (draft_ns + others_pass_ns) + verify_ns


def round_rates(
    alpha: float,
    max_gamma: int,
    verify: PassLoad,
    draft: PassLoad,
    predraft_hit_rate: float | None = None,
    round_times: RoundTimes | None = None,
) -> list[float]:
    """Expected committed tokens per ns of a round of each γ in [0, max_gamma] (index γ; 0 = plain decoding),
    each kind's predicted round time scaled by its measured slowdown (round_times)."""

    def slowdown(speculative: bool) -> float:
        return round_times.slowdown(speculative, verify.rows) if round_times is not None else 1.0

    rates = [1.0 / max(round_ns(0, verify, draft) * slowdown(False), 1.0)]
    for gamma in range(1, max_gamma + 1):
        predicted_ns = round_ns(gamma, verify, draft, predraft_hit_rate) * slowdown(True)
        rates.append(expected_tokens(alpha, gamma) / max(predicted_ns, 1.0))
    return rates


def choose_gamma(
    alpha: float,
    max_gamma: int,
    verify: PassLoad,
    draft: PassLoad | None,
    predraft_hit_rate: float | None = None,
    round_times: RoundTimes | None = None,
) -> int:
    """The γ in [0, max_gamma] with the most expected committed tokens per unit time (0 = plain decoding),
    each kind's predicted round time scaled by its measured slowdown (round_times). When round_times says a
    kind is due for a re-timing, this round is of that kind (the best speculative γ, or 0)."""
    if draft is None:
        return 0
    recheck = round_times.claim_recheck(verify.rows) if round_times is not None and max_gamma > 0 else None
    if recheck is False:
        return 0
    rates = round_rates(alpha, max_gamma, verify, draft, predraft_hit_rate, round_times)
    if recheck:
        rates[0] = 0.0  # any speculative γ beats plain decoding this round
    return max(range(len(rates)), key=lambda gamma: (rates[gamma], -gamma))


def speculation_gain(
    alpha: float,
    max_gamma: int,
    verify: PassLoad,
    draft: PassLoad,
    predraft_hit_rate: float | None = None,
    round_times: RoundTimes | None = None,
) -> float:
    """The predicted speedup of the best speculative γ over plain decoding (expected tokens per unit time)."""
    rates = round_rates(alpha, max_gamma, verify, draft, predraft_hit_rate, round_times)
    return max(rates[1:], default=0.0) / rates[0]


def fresh_draft_pays(
    alpha: float, gamma: int, verify: PassLoad, draft: PassLoad, round_times: RoundTimes | None = None
) -> bool:
    """After a verdict no pre-draft guessed (overlapped mode): whether drafting a γ block afresh returns more
    tokens per unit time than a plain step at once. The fresh block pays the draft time and, under load, the pass
    the verifier runs meanwhile for the sessions whose blocks were pre-drafted; the plain step rides that pass.
    On an idle verifier drafting afresh pays; as the batch grows the plain step takes over."""

    def slowdown(speculative: bool) -> float:
        return round_times.slowdown(speculative, verify.rows) if round_times is not None else 1.0

    fresh_ns = round_ns(gamma, verify, draft, predraft_hit_rate=0.0) * slowdown(True)
    plain_ns = round_ns(0, verify, draft) * slowdown(False)
    return expected_tokens(alpha, gamma) / max(fresh_ns, 1.0) > 1.0 / max(plain_ns, 1.0)


def predraft_steps(
    max_steps: int, verify_tokens: float, verify: PassLoad, draft: PassLoad, own_rows: float = 0.0
) -> int:
    """How many batched draft passes a pre-draft makes (at least 1, at most max_steps): the most that are expected
    to end within the verify call they overlap (a pass feeding verify_tokens tokens), with a row of its own besides
    the drafter's other sessions (its batch less own_rows, the rows this request's last pre-draft fed). A
    pre-draft that outlasts its verification delays the next round by the difference even when it guessed the
    verdict, so the blocks it hands over are as long as fits, not longer."""
    verify_ns = verify.call_ns(verify_tokens)
    pass_ns = draft.cost.predict_ns(max(draft.rows - own_rows, 0.0) + 1.0)
    fitting = int((verify_ns - draft.call_overhead_ns) // max(pass_ns, 1.0))
    return max(1, min(max_steps, fitting))


def affordable_guesses(
    max_guesses: int, draft_steps: int, verify_tokens: float, verify: PassLoad, draft: PassLoad
) -> int:
    """How many guessed verdicts to pre-draft (at least 1, at most max_guesses): the most whose pre-draft,
    draft_steps batched passes with a row per guess besides the drafter's other sessions, is expected to end
    within the verify call it overlaps (a pass feeding verify_tokens tokens). Past that, guesses would delay
    the next round instead of hiding its draft."""
    verify_ns = verify.call_ns(verify_tokens)
    for count in range(max_guesses, 1, -1):
        predraft_ns = draft_steps * draft.cost.predict_ns(max(draft.rows, float(count))) + draft.call_overhead_ns
        if predraft_ns <= verify_ns:
            return count
    return 1
