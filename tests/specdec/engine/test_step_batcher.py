"""StepBatcher: calls that queue while a step runs are batched, one call per session, errors stay per call."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from specdec.engine.step_batcher import NOT_YET, StepBatcher


class Recorder:
    """A batch function that records each batch and can be held while calls queue up behind it."""

    def __init__(self):
        self.batches: list[list[tuple]] = []
        self.release = threading.Event()

    def __call__(self, calls):
        self.release.wait(5)
        self.batches.append(list(calls))
        return [ValueError(f"bad {args[0]}") if args[1] < 0 else args[1] * 10 for args in calls]


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 10))


def sessions_per_batch(recorder: Recorder) -> list[list[str]]:
    return [[args[0] for args in batch] for batch in recorder.batches]


async def queued_behind_a_held_step(batcher: StepBatcher, recorder: Recorder, calls: list[tuple]):
    """Sends one call, then `calls` while it is held, then lets everything run; returns all outcomes."""
    first = batcher.submit("step", "first", 1)
    await asyncio.sleep(0.05)  # the worker has taken `first` and waits on the event
    rest = [batcher.submit("step", *args) for args in calls]
    recorder.release.set()
    return await asyncio.gather(first, *rest, return_exceptions=True)


def test_calls_that_queue_during_a_step_run_as_one_batch():
    recorder = Recorder()
    batcher = StepBatcher({"step": recorder}, max_batch_size=8, name="test")
    outcomes = run(queued_behind_a_held_step(batcher, recorder, [("a", 2), ("b", 3), ("c", 4)]))
    batcher.close()
    assert outcomes == [10, 20, 30, 40]
    assert [len(batch) for batch in recorder.batches] == [1, 3]


def test_batches_hold_one_call_per_session_and_respect_the_size_limit():
    recorder = Recorder()
    batcher = StepBatcher({"step": recorder}, max_batch_size=2, name="test")
    calls = [("a", 1), ("a", 2), ("b", 3), ("c", 4)]
    outcomes = run(queued_behind_a_held_step(batcher, recorder, calls))
    batcher.close()
    assert outcomes == [10, 10, 20, 30, 40]
    assert sessions_per_batch(recorder) == [["first"], ["a", "b"], ["a", "c"]]
    assert [args[1] for args in recorder.batches[2] if args[0] == "a"] == [2]  # a session's calls keep their order


def test_an_error_fails_its_own_call_only():
    recorder = Recorder()
    batcher = StepBatcher({"step": recorder}, max_batch_size=8, name="test")
    outcomes = run(queued_behind_a_held_step(batcher, recorder, [("a", -1), ("b", 2)]))
    batcher.close()
    assert outcomes[0] == 10 and isinstance(outcomes[1], ValueError) and outcomes[2] == 20


def test_batch_size_one_runs_every_call_alone_in_arrival_order():
    recorder = Recorder()
    batcher = StepBatcher({"step": recorder}, max_batch_size=1, name="test")
    run(queued_behind_a_held_step(batcher, recorder, [("a", 1), ("b", 2), ("c", 3)]))
    batcher.close()
    assert [batch[0][0] for batch in recorder.batches] == ["first", "a", "b", "c"]


def test_one_off_calls_and_a_failing_step():
    def broken(calls):
        raise RuntimeError("model failed")

    batcher = StepBatcher({"step": broken}, max_batch_size=4, name="test")

    async def main():
        assert await batcher.run(lambda x: x + 1, 41) == 42
        with pytest.raises(RuntimeError, match="model failed"):
            await batcher.submit("step", "a", 1)
        with pytest.raises(KeyError):
            batcher.submit("unknown", "a")

    run(main())
    batcher.close()
    with pytest.raises(ValueError, match="max_batch_size"):
        StepBatcher({}, max_batch_size=0, name="test")


def waiting_batcher() -> tuple[Recorder, StepBatcher]:
    """A batcher whose steps run at once and wait up to 1 s for the sessions expected back."""
    recorder = Recorder()
    recorder.release.set()
    return recorder, StepBatcher({"step": recorder}, max_batch_size=8, name="test", max_wait_s=1.0)


async def second_round(batcher: StepBatcher, follows, late_s: float) -> None:
    """Sessions a and b share a step; then a calls again at once and b only after late_s."""
    await asyncio.gather(
        batcher.submit("step", "a", 1, follows=follows), batcher.submit("step", "b", 2, follows=follows)
    )
    again = batcher.submit("step", "a", 3)
    await asyncio.sleep(late_s)
    await asyncio.gather(again, batcher.submit("step", "b", 4))


def test_a_step_waits_for_the_sessions_of_the_last_step_that_are_on_their_way():
    recorder, batcher = waiting_batcher()
    run(second_round(batcher, None, late_s=0.2))
    batcher.close()
    assert sessions_per_batch(recorder)[-1] == ["a", "b"]  # a's step waited for b instead of running alone


def test_a_session_whose_result_says_its_next_call_is_not_coming_at_once_is_not_waited_for():
    recorder, batcher = waiting_batcher()
    run(second_round(batcher, lambda result: result < 20, late_s=0.2))  # a's result 10: yes; b's 20: no
    batcher.close()
    assert sessions_per_batch(recorder)[-2:] == [["a"], ["b"]]


def test_a_one_off_call_on_a_session_ends_the_wait_for_it():
    recorder, batcher = waiting_batcher()

    async def main():
        await asyncio.gather(batcher.submit("step", "a", 1), batcher.submit("step", "b", 2))
        again = batcher.submit("step", "a", 3)
        closed = batcher.run(lambda session: f"closed {session}", "b")  # b ends instead of calling again
        assert await closed == "closed b"
        await asyncio.sleep(0.2)
        await asyncio.gather(again, batcher.submit("step", "c", 4))

    run(main())
    batcher.close()
    assert sessions_per_batch(recorder)[-2:] == [["a"], ["c"]]  # no step waited for b after its close


def test_an_urgent_call_ends_the_wait_for_the_sessions_on_their_way():
    recorder, batcher = waiting_batcher()

    async def main():
        await asyncio.gather(batcher.submit("step", "a", 1), batcher.submit("step", "b", 2))
        again = batcher.submit("step", "a", 3)
        opened = batcher.submit("step", "c", 4, urgent=True)  # a new session's open: its first token is awaited
        await asyncio.sleep(0.2)
        await asyncio.gather(again, opened, batcher.submit("step", "b", 5))

    run(main())
    batcher.close()
    assert sessions_per_batch(recorder)[-2:] == [["a", "c"], ["b"]]  # without `urgent`: one step of a, c and b


def next_call(tag: str, add: int):
    """A follow-up's choice: the session's next call adds `add` to its last result (None runs nothing)."""
    return lambda last: None if last is None else (tag, ("a", last + add))


def test_a_follow_up_queued_with_the_call_before_it_runs_in_the_next_step_on_that_calls_result():
    recorder = Recorder()
    batcher = StepBatcher({"step": recorder}, max_batch_size=8, name="test")

    async def main():
        first = batcher.submit("step", "first", 1)
        await asyncio.sleep(0.05)  # the worker holds `first`; the next two queue behind it
        pending = batcher.submit("step", "a", 2)
        follow_up = batcher.submit_follow_up("step", "a", next_call("guess 0", 1))
        recorder.release.set()
        return await asyncio.gather(first, pending, follow_up)

    outcomes = run(main())
    batcher.close()
    assert outcomes == [10, 20, ("guess 0", 210)]  # chosen after a's 20: the call ("a", 21)
    assert recorder.batches[1:] == [[("a", 2)], [("a", 21)]]


def test_a_follow_up_arriving_after_the_call_before_it_is_decided_at_once():
    recorder, batcher = waiting_batcher()

    async def main():
        assert await batcher.submit("step", "a", 2) == 20
        return await batcher.submit_follow_up("step", "a", next_call("late", 5))

    assert run(main()) == ("late", 250)
    batcher.close()
    assert recorder.batches[-1] == [("a", 25)]


def test_a_follow_up_that_chooses_nothing_resolves_to_none_and_its_session_is_not_waited_for():
    recorder = Recorder()
    batcher = StepBatcher({"step": recorder}, max_batch_size=8, name="test", max_wait_s=1.0)

    async def main():
        first = batcher.submit("step", "first", 1, follows=lambda result: False)
        await asyncio.sleep(0.05)  # held, so a's call and its follow-up share the next drain
        pending = batcher.submit("step", "a", 2)
        nothing = batcher.submit_follow_up("step", "a", lambda last: None)
        recorder.release.set()
        assert await asyncio.gather(first, pending, nothing) == [10, 20, None]
        other = batcher.submit("step", "c", 3)  # would wait for a, were a still expected
        await asyncio.sleep(0.2)
        await asyncio.gather(other, batcher.submit("step", "a", 4))

    run(main())
    batcher.close()
    assert sessions_per_batch(recorder)[-2:] == [["c"], ["a"]]


def test_a_cancelled_follow_up_runs_nothing_and_a_failing_choice_fails_the_follow_up_only():
    recorder = Recorder()
    batcher = StepBatcher({"step": recorder}, max_batch_size=8, name="test")

    def broken(last):
        raise RuntimeError("no choice")

    async def main():
        first = batcher.submit("step", "first", 1)
        await asyncio.sleep(0.05)
        pending = batcher.submit("step", "a", 2)
        cancelled = batcher.submit_follow_up("step", "a", next_call("never", 1))
        cancelled.cancel()
        failing = batcher.submit_follow_up("step", "first", broken)
        recorder.release.set()
        assert await asyncio.gather(first, pending) == [10, 20]
        with pytest.raises(RuntimeError, match="no choice"):
            await failing

    run(main())
    batcher.close()
    assert recorder.batches[1:] == [[("a", 2)]]


def test_a_follow_up_that_overtook_its_call_waits_for_it():
    recorder, batcher = waiting_batcher()

    async def main():
        early = batcher.submit_follow_up("step", "a", lambda last: NOT_YET if last is None else ("t", ("a", last + 1)))
        await asyncio.sleep(0.05)  # decided already: NOT_YET, held
        return await asyncio.gather(batcher.submit("step", "a", 2), early)

    assert run(main()) == [20, ("t", 210)]
    batcher.close()
    assert recorder.batches == [[("a", 2)], [("a", 21)]]


class PassCounter:
    """A joining step function: each call (session, passes) is answered with passes * 10 after that many passes;
    the first pass is held until `release` is set while calls queue up (pass i, until holds[i] is set). Records
    which calls each pass held."""

    def __init__(self):
        self.passes: list[list[str]] = []
        self.release = threading.Event()
        self.holds = {0: self.release}
        self.pass_s = 0.0  # how long each pass takes

    def __call__(self, step):
        left = {index: args[1] for index, args in enumerate(step.calls)}
        while left:
            left.update((index, step.calls[index][1]) for index in step.join())
            if len(self.passes) in self.holds:
                self.holds[len(self.passes)].wait(5)
            time.sleep(self.pass_s)
            self.passes.append(sorted(step.calls[index][0] for index in left))
            for index in list(left):
                left[index] -= 1
                if not left[index]:
                    del left[index]
                    step.finish(index, step.calls[index][1] * 10)


def joining_batcher(max_batch_size: int) -> tuple[PassCounter, StepBatcher, list[tuple[str, int]]]:
    counter, steps = PassCounter(), []
    batcher = StepBatcher(
        {},
        max_batch_size=max_batch_size,
        name="test",
        joining_fns={"step": counter},
        on_step=lambda kind, calls: steps.append((kind, calls)),
    )
    return counter, batcher, steps


def test_calls_that_queue_during_a_joining_step_join_it_at_its_next_pass_and_leave_when_done():
    counter, batcher, steps = joining_batcher(max_batch_size=8)
    counter.holds[2] = third_pass = threading.Event()

    async def main():
        first = batcher.submit("step", "first", 3)
        await asyncio.sleep(0.05)  # the first pass holds `first` alone
        short, long = batcher.submit("step", "short", 1), batcher.submit("step", "long", 3)
        counter.release.set()
        assert await short == 10  # answered after its own pass, while the step goes on
        third_pass.set()
        return await asyncio.gather(first, long)

    assert run(main()) == [30, 30]
    batcher.close()
    assert counter.passes == [["first"], ["first", "long", "short"], ["first", "long"], ["long"]]
    assert steps == [("step", 3)]


def test_only_calls_of_the_kind_on_new_sessions_join_within_the_size_limit_and_the_rest_keep_their_order():
    counter, batcher, steps = joining_batcher(max_batch_size=3)

    async def main():
        first = batcher.submit("step", "first", 3)
        await asyncio.sleep(0.05)
        calls = [
            batcher.submit("step", "first", 1),  # its session is in the step: next step
            batcher.submit("step", "d", 1),
            batcher.submit("step", "e", 1),  # join (3 calls in all)
            batcher.submit("step", "f", 1),  # no room left: joins once d and e are done
        ]
        counter.release.set()
        return await asyncio.gather(first, *calls)

    assert run(main()) == [30, 10, 10, 10, 10]
    batcher.close()
    assert counter.passes == [["first"], ["d", "e", "first"], ["first"], ["f", "first"]]
    assert steps == [("step", 3), ("step", 2)]


def test_a_waiting_call_of_another_kind_ends_the_intake_and_keeps_its_place():
    counter, batcher, steps = joining_batcher(max_batch_size=3)
    events = []

    async def main():
        first = batcher.submit("step", "first", 2)
        await asyncio.sleep(0.05)
        calls = [
            batcher.submit("step", "b", 1),  # queued before the one-off: joins
            batcher.run(lambda session: events.append(f"closed {session}"), "c"),  # from here on nothing joins
            batcher.submit("step", "c", 1),
            batcher.submit("step", "d", 1),
            batcher.submit("step", "e", 1),
        ]
        counter.release.set()
        return await asyncio.gather(first, *calls)

    assert run(main()) == [20, 10, None, 10, 10, 10]
    batcher.close()
    assert counter.passes == [["first"], ["b", "first"], ["c", "d", "e"]]
    assert events == ["closed c"] and steps == [("step", 2), ("step", 3)]


def test_near_saturation_opens_and_closes_wait_a_bounded_number_of_passes():
    """A joining step kept busy by a steady stream of calls (one more per pass, each needing 3 passes): an open and
    a close queued meanwhile are served within the passes the step's calls still need, not after the stream."""
    passes_per_call, stream_length = 3, 120
    counter = PassCounter()
    counter.release.set()
    counter.pass_s = 0.002  # each pass takes a moment, so the stream keeps arriving between passes
    opened: list[str] = []
    served_at: dict[str, int] = {}  # passes run when the batcher's thread served the open / the close

    def open_sessions(calls):
        served_at["open"] = len(counter.passes)
        return [opened.append(args[0]) or 0 for args in calls]

    def close_session(session):
        served_at["close"] = len(counter.passes)
        opened.append(f"closed {session}")

    batcher = StepBatcher({"open": open_sessions}, max_batch_size=16, name="test", joining_fns={"step": counter})

    async def main():
        stream = []
        for index in range(stream_length):  # one new call each pass
            seen = len(counter.passes)
            stream.append(batcher.submit("step", f"s{index}", passes_per_call))
            if index == 10:
                queued_at = len(counter.passes)
                close = batcher.run(close_session, "s0")
                open_ = batcher.submit("open", "new")
            for _ in range(1000):
                if len(counter.passes) > seen:
                    break
                await asyncio.sleep(0.001)
        await asyncio.gather(*stream, close, open_)
        return {what: at - queued_at for what, at in served_at.items()}

    waited = run(main())
    batcher.close()
    assert opened == ["closed s0", "new"]
    assert waited["close"] <= passes_per_call + 1 and waited["open"] <= passes_per_call + 1, waited


def test_batch_size_one_joins_nothing_and_a_failing_joining_step_fails_the_calls_it_had_not_answered():
    counter, batcher, _ = joining_batcher(max_batch_size=1)

    async def alone():
        first = batcher.submit("step", "first", 2)
        await asyncio.sleep(0.05)
        second = batcher.submit("step", "second", 1)
        counter.release.set()
        return await asyncio.gather(first, second)

    assert run(alone()) == [20, 10]
    batcher.close()
    assert counter.passes == [["first"], ["first"], ["second"]]

    def answers_one_then_fails(step):
        step.finish(0, "done")
        raise RuntimeError("model failed")

    failing = StepBatcher({}, max_batch_size=4, name="test", joining_fns={"step": answers_one_then_fails})

    async def both():
        return await asyncio.gather(
            failing.submit("step", "a", 1), failing.submit("step", "b", 1), return_exceptions=True
        )

    outcomes = run(both())
    failing.close()
    assert outcomes[0] == "done" and isinstance(outcomes[1], RuntimeError)
