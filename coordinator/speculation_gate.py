"""Speculation that steps aside when it stops paying, judged from the throughput measured each way.

The γ policy (coordinator/speculation_policy.py) predicts a round's cost from the replicas' pass costs. What it
cannot see is what speculating costs the other requests: on shared hardware the drafter takes cycles the verifier
needs, and a batch whose sessions wait for their drafts is a smaller batch. The gate measures the outcome itself.
At each load level (active generations, log2) it runs epochs with speculation allowed and epochs in which every
round is plain (γ = 0 through the verifier), compares the tokens committed per second over all requests, and keeps
the better way; the other is measured again now and then, more often while the two are close. Where the verifier
does not batch, or the γ policy predicts a wide gain for speculation (its fixed pass cost dominates), plain epochs
would only cost, so none are run there. Speculation must win by a margin to be kept. Its gain falls as the load
grows, so a level above one that keeps plain rounds starts with plain rounds too: it measures speculation only at its
rechecks, not in epochs of its own first, and a load that climbs past the point where speculation stops paying does
not pay for that lesson again at every level (docs/architecture.md, "The speculation policy").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from coordinator.speculation_policy import log2_level

log = logging.getLogger(__name__)

EPOCH_S = 3.0  # length of an epoch of one way at one load level
SETTLE_S = 0.5  # start of an epoch left out of its measurement (rounds of the previous way still finishing)
MIN_EPOCHS = 2  # epochs of each way at a level before the measured rates decide
SMOOTHING = 0.3  # weight of the newest epoch in a way's running rate
CLOSE_GAP = 0.15  # ways within this relative gap are "close": the slower one is measured again more often
RECHECK_CLOSE = 6  # while close, every this many epochs runs the slower way
RECHECK_WIDE = 16  # otherwise every this many
# Speculation is kept at a level only while it measures this much faster than plain rounds: each switch to it
# costs outside the measured epochs (every draft lane catches up on the tokens plain rounds committed), and on a
# tie plain rounds are the safe side.
SPECULATION_MARGIN = 0.05
CONTESTED_GAIN = 1.5  # the γ policy's predicted speedup of speculation below which the gate measures both ways
CONTESTED_ROWS = 2.0  # ...where the verifier batches: sessions per pass, on average, from which it measures both


@dataclass
class WayThroughput:
    """Running committed tokens/s of one way (speculative or plain) at one load level."""

    tokens_per_s: float = 0.0
    epochs: int = 0

    def observe(self, tokens_per_s: float) -> None:
        self.epochs += 1
        self.tokens_per_s += max(SMOOTHING, 1.0 / self.epochs) * (tokens_per_s - self.tokens_per_s)


@dataclass
class Epoch:
    """The way in force at a load level since started_s, and where its measurement starts."""

    level: int
    speculative: bool
    started_s: float
    mark_s: float | None = None  # first commit after the settling time
    mark_tokens: int = 0  # tokens committed (all requests) at mark_s


class SpeculationGate:
    """Coordinator-wide epochs of speculative and plain rounds per load level, and the way each level keeps."""

    def __init__(
        self,
        epoch_s: float = EPOCH_S,
        clock: Callable[[], float] = time.monotonic,
        on_measured: Callable[[int, bool, float], None] | None = None,
    ):
        self._epoch_s = epoch_s
        self._clock = clock
        self._on_measured = on_measured  # (level, speculative, running tokens/s) after each measured epoch
        self.active = 0  # generations running
        self.tokens = 0  # tokens committed by all requests so far
        self._ways: dict[int, dict[bool, WayThroughput]] = {}  # level -> {speculative: its throughput}
        self._epochs_run: dict[int, int] = {}  # level -> contested epochs started there
        self._kept: dict[int, bool] = {}  # level -> the way kept there (speculative or not), once measured
        self._epoch: Epoch | None = None

    def enter(self) -> None:
        self.active += 1

    def leave(self) -> None:
        self.active -= 1

    def committed(self, tokens: int) -> None:
        """A round of any request committed `tokens` tokens."""
        self.tokens += tokens
        epoch = self._epoch
        if epoch is not None and epoch.mark_s is None and (now := self._clock()) - epoch.started_s >= SETTLE_S:
            epoch.mark_s, epoch.mark_tokens = now, self.tokens

    def throughput(self, level: int, speculative: bool) -> WayThroughput:
        """The measured throughput of a way at a level (0 epochs: never measured)."""
        return self._ways.get(level, {}).get(speculative, WayThroughput())

    def allows_speculation(self, contested: Callable[[], bool]) -> bool:
        """Whether this round may speculate. contested(): whether the γ policy's predicted gain from speculating is
        small enough (below CONTESTED_GAIN) that the gate should measure both ways at this load; asked only when an
        epoch starts or a plain one is in force (a speculative epoch's rounds need no prediction)."""
        now, level = self._clock(), log2_level(self.active)
        epoch = self._epoch
        if epoch is None or epoch.level != level or now - epoch.started_s >= self._epoch_s:
            if epoch is not None and epoch.level == level:
                self._record(epoch, now)
            epoch = self._epoch = self._next_epoch(level, now, contested())
        elif not epoch.speculative and not contested():
            return True  # this request's own prediction says speculate clearly: a plain epoch is not for it
        return epoch.speculative

    def _plain_kept_below(self, level: int) -> bool:
        """Whether a lighter load level measured plain rounds faster and keeps them."""
        return any(not speculating for lower, speculating in self._kept.items() if lower < level)

    def _record(self, epoch: Epoch, now: float) -> None:
        if epoch.mark_s is None or now <= epoch.mark_s:
            return
        ways = self._ways.setdefault(epoch.level, {True: WayThroughput(), False: WayThroughput()})
        way = ways[epoch.speculative]
        way.observe((self.tokens - epoch.mark_tokens) / (now - epoch.mark_s))
        if self._on_measured is not None:
            self._on_measured(epoch.level, epoch.speculative, way.tokens_per_s)

    def _next_epoch(self, level: int, now: float, contested: bool) -> Epoch:
        if not contested:
            return Epoch(level, True, now)
        run = self._epochs_run[level] = self._epochs_run.get(level, 0) + 1
        speculative, plain = self.throughput(level, True), self.throughput(level, False)
        if min(speculative.epochs, plain.epochs) < MIN_EPOCHS:
            if self._plain_kept_below(level):  # it pays less under more load: plain until its rechecks say otherwise
                return Epoch(level, run % RECHECK_WIDE == 0, now)
            return Epoch(level, speculative.epochs <= plain.epochs, now)
        faster = speculative.tokens_per_s >= plain.tokens_per_s * (1 + SPECULATION_MARGIN)  # the way to keep
        if self._kept.get(level) != faster:
            self._kept[level] = faster
            log.info(
                "speculation gate: %s at load level %d (%d running): speculative %.1f tok/s, plain %.1f tok/s",
                "speculating" if faster else "plain rounds",
                level,
                self.active,
                speculative.tokens_per_s,
                plain.tokens_per_s,
            )
        gap = abs(speculative.tokens_per_s - plain.tokens_per_s) / max(
            speculative.tokens_per_s, plain.tokens_per_s, 1e-9
        )
        recheck_every = RECHECK_CLOSE if gap < CLOSE_GAP else RECHECK_WIDE
        return Epoch(level, faster if run % recheck_every else not faster, now)
