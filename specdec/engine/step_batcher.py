"""Continuous batching of a service's model work on one worker thread.

Calls are queued from the event loop. Each time the worker is free it takes everything queued, runs the
one-off calls (close, ...) in arrival order, then every batchable kind (open, verify, propose) as batches
of at most `max_batch_size` calls on distinct sessions (a call's first argument is its session id)
through that kind's batch function, which does one model pass for all of them. Sessions thus join and leave
the running batch between steps. `max_batch_size` 1 turns batching off (one call per step, in arrival order).

In a disaggregated stack every step of a session is a round trip: its next call leaves the caller only
after the previous reply arrived. Taking only what is queued would then split the sessions into groups that
take turns, each paying a whole pass for part of the batch. So before a step the worker waits, at most
`max_wait_s`, for the sessions of the last step that are expected back at once. A call says whether its session
is, given its result (`follows`; a caller that knows, e.g. a coordinator that has the next block drafted only for
some verdicts, says so); without it every session served is expected back, and a one-off call on a session (its
close) ends the wait for it. A call submitted as `urgent` (a new session's open, whose first token a client awaits)
ends the wait altogether: it runs in the next step with what is queued, not after the sessions on their way.

A caller may also queue a *follow-up*: the session's next call, decided by the result of the call before it
(e.g. a next round drafted under guesses of a verdict not known yet). The worker holds it until that call has
run, then asks it which call to make (`choose`); the chosen call joins the next step at once, without waiting
for a round trip to the caller and back. A follow-up that overtook the call it follows (its choice says NOT_YET)
waits for the session's next call to run.

A kind may also be *joining*: its step function runs a step of several model passes (a drafter's proposals,
one pass per drafted position) and, between passes, takes in calls of that kind queued since (`JoiningStep.join`)
and answers each call as soon as it is done (`JoiningStep.finish`). A call arriving while such a step runs then
waits for one pass, not for the whole step. A call of any other kind (an open, a close) arriving meanwhile ends the
intake: the step finishes the calls it holds (at most as many passes as one call needs) and the next drain serves
that call, so near saturation opens and closes still wait a bounded number of passes, not until their deadline.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from specdec.common.settings import setting

log = logging.getLogger(__name__)

T = TypeVar("T")


class NotYet:
    """A follow-up's choice while the call it follows has not run yet: decide again after the session's next call."""

    def __repr__(self) -> str:
        return "NOT_YET"


NOT_YET = NotYet()
BatchFn = Callable[[Sequence[tuple]], Sequence[Any]]  # argument tuples -> per call a result or an Exception
# Given the result (or Exception; None if there is none) of the session's last batchable call: (a tag, the
# argument tuple of the call to run), None to run nothing, or NOT_YET.
FollowUpChoice = Callable[[Any], tuple[Any, tuple] | None | NotYet]
JoiningFn = Callable[["JoiningStep"], None]  # runs a step, finishing every call in it (see JoiningStep)


def only_result(results: Sequence[T | Exception]) -> T:
    """The result of a one-call batch (a batch function called for a single call); raises its error."""
    if isinstance(results[0], Exception):
        raise results[0]
    return results[0]


class JoiningStep:
    """A running step of a joining kind: the argument tuples of its calls (`calls`, in joining order; a call's
    index is its place there), more calls taken in between passes, and each call answered once it is done.

    This base is a step of fixed calls (nothing joins) that collects the results; the batcher's own takes in
    queued calls.
    """

    def __init__(self, calls: Sequence[tuple]):
        self.calls: list[tuple] = list(calls)
        self.results: list[Any] = [None] * len(self.calls)  # per call its result or Exception, once finished

    def join(self) -> list[int]:
        """Takes in the calls queued since the step began or last joined; returns their indexes in `calls`."""
        return []

    def finish(self, index: int, result: Any) -> None:
        """Answers call `index` with its result (or Exception)."""
        self.results[index] = result


def run_joining(fn: JoiningFn, calls: Sequence[tuple]) -> list[Any]:
    """Runs a joining kind's step function over fixed calls, like a batch function; per call its result or error."""
    step = JoiningStep(calls)
    fn(step)
    return step.results


@dataclass(frozen=True)
class _Call:
    kind: str | None  # a batchable kind, or None for a one-off call of `fn`
    fn: Callable[..., Any] | None
    args: tuple
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    follows: Callable[[Any], bool] | None = None  # given the call's result: is its session's next call on its way?
    choose: FollowUpChoice | None = None  # set on a follow-up: decides the call to run once the previous one ran
    tag: Any = None  # a call chosen by a follow-up: its future resolves to (tag, result)
    tagged: bool = False
    urgent: bool = False  # ends a step's wait for the sessions on their way (a new session's open)

    @property
    def session(self) -> object:
        """The session the call is on (its first argument), or None."""
        return self.args[0] if self.args else None


@dataclass(frozen=True)
class StepBatchingSettings:
    """The batching part of a model service's settings (a base of each one's settings class)."""

    max_batch_size: int = setting(
        32, "most calls run together in one model step (continuous batching; 1 = off: one session per step)"
    )
    max_batch_wait_ms: float = setting(
        20.0,
        "longest a step waits for sessions of the last step whose next call is on its way (0 = run what is queued)",
    )


class StepBatcher:
    """One worker thread that runs queued model work, batching calls of the same kind."""

    def __init__(
        self,
        batch_fns: Mapping[str, BatchFn],
        max_batch_size: int,
        name: str,
        on_step: Callable[[str, int], None] | None = None,
        max_wait_s: float = 0.0,
        joining_fns: Mapping[str, JoiningFn] | None = None,
        thread_cpus: frozenset[int] = frozenset(),
    ):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.batch_fns = dict(batch_fns)
        self.joining_fns = dict(joining_fns or {})  # kinds whose steps take in calls between passes (run instead)
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s if max_batch_size > 1 else 0.0
        self.on_step = on_step  # (kind, calls in the batch), e.g. a batch-size histogram
        self._expected: set[object] = set()  # sessions of the last step whose next call is on its way
        self._served: set[object] = set()  # ...those of the step running now
        self._last_results: dict[object, Any] = {}  # per session the result of its last batchable call
        self._chosen: list[_Call] = []  # calls chosen by follow-ups, for the next step
        self._held: dict[object, list[_Call]] = {}  # per session the follow-ups waiting for a call of it to run
        self._queue: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._carried: list[_Call] = []  # calls a joining step took off the queue but left for the next drain
        self._thread_cpus = thread_cpus  # cores the worker (and the torch threads it starts) runs on; empty: inherited
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(
        self, kind: str, *args, follows: Callable[[Any], bool] | None = None, urgent: bool = False
    ) -> asyncio.Future:
        """Queues one call of a batchable kind; the future resolves to its result or raises its error.
        `follows(result)` says whether the session's next call comes at once (None: it does); an `urgent` call
        does not wait for the sessions on their way."""
        self._check_kind(kind)
        return self._enqueue(kind, None, args, follows, urgent)

    def submit_follow_up(
        self, kind: str, session: object, choose: FollowUpChoice, follows: Callable[[Any], bool] | None = None
    ) -> asyncio.Future:
        """Queues the session's next call of `kind`, decided once the call before it has run: `choose(result)`
        gives (tag, args) of the call to run in the next step (args[0] is the session), None for none, or NOT_YET to
        wait for the session's next call. The future resolves to (tag, that call's result) or None."""
        self._check_kind(kind)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put(_Call(kind, None, (session,), future, loop, follows, choose))
        return future

    def run(self, fn: Callable[..., Any], *args) -> asyncio.Future:
        """Queues a one-off call on the worker thread (it runs between batches, never beside one)."""
        return self._enqueue(None, fn, args)

    def close(self, wait: bool = True) -> None:
        """Stops the worker after the calls already queued (without waiting when wait is False)."""
        self._queue.put(None)
        if wait:
            self._thread.join()

    def _check_kind(self, kind: str) -> None:
        if kind not in self.batch_fns and kind not in self.joining_fns:
            raise KeyError(f"no batch function for {kind!r}")

    def _enqueue(
        self,
        kind: str | None,
        fn: Callable[..., Any] | None,
        args: tuple,
        follows: Callable[[Any], bool] | None = None,
        urgent: bool = False,
    ) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put(_Call(kind, fn, args, future, loop, follows, urgent=urgent))
        return future

    def _work(self) -> None:
        if self._thread_cpus:
            os.sched_setaffinity(0, self._thread_cpus)  # 0: this thread only, not the process
        while True:
            chosen, self._chosen = self._chosen, []  # they queue behind the calls that arrived before them
            calls, self._carried = self._carried, []
            if not chosen and not calls:
                first = self._queue.get()
                if first is None:
                    return
                calls.append(first)
            calls.extend(self._drain_queue())
            calls.extend(chosen)
            self._wait_for_expected_sessions(calls)
            self._served = set()
            self._run_round(calls)
            self._expected = self._served

    def _drain_queue(self) -> list[_Call]:
        """The calls queued now, without waiting; a stop request stays queued, to end the worker after them."""
        drained = []
        while not self._queue.empty():
            call = self._queue.get_nowait()
            if call is None:
                self._queue.put(None)
                break
            drained.append(call)
        return drained

    def _wait_for_expected_sessions(self, calls: list[_Call]) -> None:
        """Adds calls arriving within max_wait_s while sessions of the last step that are expected back are
        missing; a one-off call on a session (e.g. its close) means it is not coming, and an urgent call ends the
        wait."""
        if self.max_wait_s <= 0 or all(call.kind is None for call in calls):
            return
        missing = set(self._expected)
        deadline = time.monotonic() + self.max_wait_s
        while True:
            missing.difference_update(call.session for call in calls)
            if not missing or any(call.urgent for call in calls):
                return
            try:
                call = self._queue.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                return
            if call is None:
                self._queue.put(None)
                return
            calls.append(call)

    def _run_round(self, calls: list[_Call]) -> None:
        """Runs one drain's calls. Batchable calls wait to be batched, except that a one-off call on a session
        (e.g. its close) first runs the batches holding that session's earlier calls, so no call overtakes
        an earlier one on the same session. A follow-up whose session has an earlier call here is held until
        that call has run; the others are decided now."""
        by_kind: dict[str, list[_Call]] = {}
        for call in calls:
            if call.future.cancelled():
                continue
            if call.choose is not None:
                if any(c.session == call.session for pending in by_kind.values() for c in pending):
                    self._held.setdefault(call.session, []).append(call)
                elif (chosen := self._decide(call)) is not None:
                    by_kind.setdefault(chosen.kind, []).append(chosen)
                continue
            if call.kind is not None:
                by_kind.setdefault(call.kind, []).append(call)
                continue
            if any(c.session == call.session for pending in by_kind.values() for c in pending):
                self._run_batches(by_kind)
                by_kind = {}
            self._run_one(call)
        self._run_batches(by_kind)

    def _run_batches(self, by_kind: dict[str, list[_Call]]) -> None:
        for kind, pending in by_kind.items():
            while pending:
                batch, pending = self._next_batch(pending)
                self._run_batch(kind, batch)

    def _next_batch(self, pending: list[_Call]) -> tuple[list[_Call], list[_Call]]:
        """Up to max_batch_size calls with distinct sessions (first argument), in arrival order; a second call
        on a session already in the batch (a retry) waits for the next batch. Returns (batch, the rest)."""
        batch: list[_Call] = []
        rest: list[_Call] = []
        sessions: set = set()
        for call in pending:
            if len(batch) < self.max_batch_size and call.session not in sessions:
                batch.append(call)
                sessions.add(call.session)
            else:
                rest.append(call)
        return batch, rest

    def _decide(self, follow_up: _Call) -> _Call | None:
        """The call a follow-up chooses given its session's last result, or None: the follow-up is then held
        (NOT_YET) or settled (None, or the error `choose` raised)."""
        try:
            choice = follow_up.choose(self._last_results.get(follow_up.session))
        except Exception as error:  # noqa: BLE001 - handed to the caller
            _settle(follow_up, error)
            return None
        if choice is NOT_YET:
            self._held.setdefault(follow_up.session, []).append(follow_up)
            return None
        if choice is None:
            _settle(follow_up, None)
            return None
        tag, args = choice
        return _Call(
            follow_up.kind, None, tuple(args), follow_up.future, follow_up.loop, follow_up.follows, tag=tag, tagged=True
        )

    def _run_one(self, call: _Call) -> None:
        try:
            result = call.fn(*call.args)
        except Exception as error:  # noqa: BLE001 - handed to the caller
            result = error
        self._last_results.pop(call.session, None)  # e.g. a close: nothing follows it
        _settle(call, result)
        self._release_held(call.session)

    def _run_batch(self, kind: str, batch: list[_Call]) -> None:
        if kind in self.joining_fns:
            self._run_joining(kind, batch)
            return
        try:
            results = self.batch_fns[kind]([call.args for call in batch])
        except Exception as error:  # noqa: BLE001 - the whole step failed: every call in it gets the error
            log.exception("%s step of %d calls failed", kind, len(batch))
            results = [error] * len(batch)
        if self.on_step is not None:
            self.on_step(kind, len(batch))
        for call, result in zip(batch, results):
            self._complete(call, result)

    def _run_joining(self, kind: str, batch: list[_Call]) -> None:
        step = _BatcherJoiningStep(self, kind, batch)
        try:
            self.joining_fns[kind](step)
        except Exception as error:  # noqa: BLE001 - the step failed: every call not yet answered gets the error
            log.exception("%s step of %d calls failed", kind, len(step.calls))
            step.finish_rest(error)
        step.finish_rest(RuntimeError(f"the {kind} step ended without answering this call"))
        if self.on_step is not None:
            self.on_step(kind, len(step.calls))

    def _complete(self, call: _Call, result: Any) -> None:
        """Records a batchable call's result and answers it."""
        self._last_results[call.session] = result
        if not isinstance(result, Exception) and (call.follows is None or call.follows(result)):
            self._served.add(call.session)
        _settle(call, result)
        if call.session in self._held and not self._release_held(call.session):
            self._served.discard(call.session)  # nothing follows at once after all

    def _take_joining(self, kind: str, room: int, in_step: set[object]) -> list[_Call]:
        """Up to `room` calls of `kind` queued since, on sessions not in the step; every other call drained stays
        for the next drain in its place, and a session's later calls stay behind it. Once a call of another kind
        (an open, a one-off such as a close, a follow-up) waits, none joins any more: the step then ends within the
        passes its calls still need, so a steady stream of joining calls cannot hold that call back."""
        joined: list[_Call] = []
        held_back = {call.session for call in self._carried}
        admitting = all(call.kind == kind and call.choose is None for call in self._carried)
        for call in self._drain_queue():
            if call.future.cancelled():
                continue
            joins_kind = call.kind == kind and call.choose is None
            admitting = admitting and joins_kind
            if admitting and len(joined) < room and call.session not in in_step and call.session not in held_back:
                joined.append(call)
                in_step.add(call.session)
            else:
                self._carried.append(call)
                held_back.add(call.session)
        return joined

    def _release_held(self, session: object) -> bool:
        """Decides the follow-ups held for `session` now that a call of it ran (the chosen calls join the next
        step); whether any chose a call."""
        chose = False
        for follow_up in self._held.pop(session, ()):
            if not follow_up.future.cancelled() and (chosen := self._decide(follow_up)) is not None:
                self._chosen.append(chosen)
                chose = True
        return chose


class _BatcherJoiningStep(JoiningStep):
    """A joining step on the batcher's worker: it takes in queued calls of its kind while fewer than
    max_batch_size of its calls are unanswered, and answers each call as it finishes."""

    def __init__(self, batcher: StepBatcher, kind: str, batch: list[_Call]):
        super().__init__([call.args for call in batch])
        self._batcher = batcher
        self._kind = kind
        self._batch = list(batch)
        self._unanswered = set(range(len(batch)))
        self._sessions = {call.session for call in batch}  # a session is in a step at most once

    def join(self) -> list[int]:
        room = self._batcher.max_batch_size - len(self._unanswered)
        if room <= 0:
            return []
        joined = self._batcher._take_joining(self._kind, room, self._sessions)
        first = len(self._batch)
        self._batch.extend(joined)
        self.calls.extend(call.args for call in joined)
        self.results.extend([None] * len(joined))
        indexes = list(range(first, len(self._batch)))
        self._unanswered.update(indexes)
        return indexes

    def finish(self, index: int, result: Any) -> None:
        if index not in self._unanswered:
            raise ValueError(f"call {index} of the step is already answered or was never in it")
        self._unanswered.discard(index)
        super().finish(index, result)
        self._batcher._complete(self._batch[index], result)

    def finish_rest(self, error: Exception) -> None:
        """Answers every call not answered yet with `error`."""
        for index in sorted(self._unanswered):
            self.finish(index, error)


def _settle(call: _Call, result: Any) -> None:
    def settle() -> None:
        if call.future.done():
            return
        if isinstance(result, BaseException):
            call.future.set_exception(result)
        else:
            call.future.set_result((call.tag, result) if call.tagged else result)

    try:
        call.loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the event loop has closed: nobody waits for this call any more
        pass
