"""--model-process: a model's passes run in a process of their own, with the same logits as in this one."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from specdec.engine.kv.session import KVSession, run_forwards
from specdec.engine.model_process import ModelProcess, ModelProcessGoneError, WaitingThreadPlacement
from specdec.engine.model_runtime import LoadedModel, ModelSettings
from specdec.engine.model_worker import SHARED_LOGIT_ROWS, GreedyLookahead, PassOrder, RowOrder, run_pass


@pytest.fixture(scope="module")
def models(tiny_pair_dirs):
    """(the target in this process, the target through a model process)."""
    settings = ModelSettings(str(tiny_pair_dirs[0]))
    remote = ModelProcess.start(LoadedModel.load(settings))
    yield LoadedModel.load(settings), remote
    remote.close()


def _decode(model, prompt, steps):
    """Greedy tokens and every step's logits [1, V] from a KVSession on `model`."""
    session = KVSession(model, prompt)
    session.cache.decodes_greedily = True  # as the verifier marks greedy plain rounds
    session.prefill()
    tokens, logits = [], []
    row = session.extend(score_previous=True)[-1:]
    for _ in range(steps):
        logits.append(row)
        tokens.append(int(row.argmax()))
        row = session.extend([tokens[-1]], score_previous=False)
    return tokens, torch.cat(logits)


def test_passes_in_the_model_process_give_this_process_logits(models):
    local, remote = models
    local_tokens, local_logits = _decode(local, [1, 5, 9, 3], 12)
    remote_tokens, remote_logits = _decode(remote, [1, 5, 9, 3], 12)
    assert remote_tokens == local_tokens
    torch.testing.assert_close(remote_logits, local_logits, rtol=1e-5, atol=1e-5)


def test_packed_rows_rollback_and_forks_match(models):
    """Several sessions in one pass, a rollback, and forks whose first writes copy shared blocks."""
    results = []
    for model in models:
        first, second = KVSession(model, list(range(1, 40))), KVSession(model, [7, 8])
        run_forwards([first.plan_prefill(), second.plan_prefill()])
        first.truncate(30)  # back into a block the fork will share
        twin = first.fork()
        logits = run_forwards([first.plan_extend([4, 4]), twin.plan_extend([9]), second.plan_extend([3, 2, 1])])
        logits += [twin.extend([5, 6]), first.extend([2], score_previous=False)]
        results.append(logits)
    for local, remote in zip(*results):
        torch.testing.assert_close(remote, local, rtol=1e-5, atol=1e-5)


def test_a_gone_model_process_fails_the_pass_saying_so(tiny_pair_dirs):
    remote = ModelProcess.start(LoadedModel.load(ModelSettings(str(tiny_pair_dirs[0]))))
    session = KVSession(remote, [1, 2, 3])
    remote.close()
    with pytest.raises(ModelProcessGoneError, match="gone"):
        session.extend([4])
    assert session.cached_len == 0  # the failed pass grew nothing


def test_a_pass_with_more_logit_rows_than_shared_memory_holds_grows_it(models):
    local, remote = models
    prompt = [1 + i % 60 for i in range(SHARED_LOGIT_ROWS + 20)]
    local_session, remote_session = KVSession(local, [1]), KVSession(remote, [1])
    got = remote_session.extend(prompt)
    assert got.shape[0] > SHARED_LOGIT_ROWS
    torch.testing.assert_close(got, local_session.extend(prompt), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(remote_session.extend([3]), local_session.extend([3]), rtol=1e-5, atol=1e-5)


def test_a_model_that_runs_one_sequence_per_pass_is_refused(tiny_pair_dirs):
    model = LoadedModel.load(ModelSettings(str(tiny_pair_dirs[0])))
    model.use_cached_forward("eager")
    with pytest.raises(ValueError, match="packed"):
        ModelProcess.start(model)


def _order(kv, start: int, token_ids, greedy: bool) -> PassOrder:
    """One row's PassOrder on kv's blocks (reserved for the positions it feeds)."""
    kv.reserve(start + len(token_ids))
    row = RowOrder(tuple(kv.table), start, tuple(token_ids), 1, greedy)
    return PassOrder((), kv.pool.allocated_blocks, (row,))


def test_the_greedy_lookahead_answers_its_own_argmax_continuation_and_nothing_else(tiny_pair_dirs):
    """Run in this process on the worker's own functions: the pass run ahead equals the pass when asked, and an
    order that differs (another token, a row not marked greedy) runs as sent."""
    model = LoadedModel.load(ModelSettings(str(tiny_pair_dirs[0])))
    kv = model.kv_pool.new_sequence()
    lookahead = GreedyLookahead(model)
    first = _order(kv, 0, [1, 5, 9, 3], greedy=True)
    logits = run_pass(model, first)
    lookahead.run_after(first, logits)
    token = int(logits[-1].argmax())
    asked = _order(kv, 4, [token], greedy=True)
    early = lookahead.answer(asked)
    assert early is not None
    torch.testing.assert_close(early, run_pass(model, asked))
    lookahead.run_after(asked, early)
    assert lookahead.answer(_order(kv, 5, [(int(early[-1].argmax()) + 1) % 64], greedy=True)) is None
    unmarked = _order(kv, 5, [token], greedy=False)
    lookahead.run_after(unmarked, run_pass(model, unmarked))
    assert lookahead.answer(_order(kv, 6, [token], greedy=False)) is None


def test_the_greedy_lookahead_runs_across_block_boundaries_in_the_scratch_block(tiny_pair_dirs):
    """A greedy decode of 4-position blocks is answered ahead at every step, a position opening a block included,
    with the logits of a model that never runs ahead; another sequence's blocks stay as they were."""
    settings = ModelSettings(str(tiny_pair_dirs[0]), kv_block_size=4)
    model, reference = LoadedModel.load(settings), LoadedModel.load(settings)
    bystander = KVSession(model, [3, 1, 4, 1, 5])
    bystander.prefill()
    bystander_keys = [keys[:, bystander.cache.table].clone() for keys in model.kv_pool.keys]
    kv, lookahead = model.kv_pool.new_sequence(), GreedyLookahead(model)
    order = _order(kv, 0, [1, 5, 9], greedy=True)
    logits = run_pass(model, order)
    expected = KVSession(reference, [1, 5, 9])
    expected_logits = expected.extend()[-1:]
    torch.testing.assert_close(logits[-1:], expected_logits)
    for position in range(3, 14):  # opens blocks at 4, 8 and 12
        lookahead.run_after(order, logits)
        token = int(logits[-1].argmax())
        order = _order(kv, position, [token], greedy=True)
        logits = lookahead.answer(order)
        assert logits is not None, f"position {position} was not run ahead"
        torch.testing.assert_close(logits, expected.extend([token], score_previous=False))
    for keys, held in zip(model.kv_pool.keys, bystander_keys):
        assert torch.equal(keys[:, bystander.cache.table], held)


def test_the_greedy_lookahead_in_the_scratch_block_is_dropped_when_the_pool_grows(tiny_pair_dirs):
    model = LoadedModel.load(ModelSettings(str(tiny_pair_dirs[0]), kv_block_size=4))
    kv, lookahead = model.kv_pool.new_sequence(), GreedyLookahead(model)
    first = _order(kv, 0, [1, 5, 9, 3], greedy=True)
    logits = run_pass(model, first)
    lookahead.run_after(first, logits)
    token = int(logits[-1].argmax())
    assert lookahead.answer(_order(kv, 4, [token], greedy=True)) is not None  # the same order at the same size
    lookahead.run_after(first, logits)
    kv.crop(-1)
    grown = _order(kv, 4, [token], greedy=True)
    assert lookahead.answer(PassOrder(grown.copies, grown.allocated_blocks * 2, grown.rows)) is None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_the_waiting_thread_leaves_the_model_cores_only_while_the_model_process_runs_ahead():
    cores = sorted(os.sched_getaffinity(0))
    model_cores, other_cores = frozenset(cores[-1:]), set(cores[:-1])
    placement = WaitingThreadPlacement(model_cores)
    moved, other_done, seen = threading.Event(), threading.Event(), []

    def model_thread() -> None:
        os.sched_setaffinity(0, model_cores)
        for runs_ahead in (False, True, True):
            placement.place(runs_ahead)
            seen.append(("model", os.sched_getaffinity(0)))
        moved.set()
        other_done.wait(10)
        placement.place(False)
        seen.append(("model", os.sched_getaffinity(0)))

    def other_thread() -> None:  # a pass from another thread meanwhile moves neither thread
        moved.wait(10)
        placement.place(False)
        seen.append(("other", os.sched_getaffinity(0)))
        other_done.set()

    threads = [threading.Thread(target=model_thread), threading.Thread(target=other_thread)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert seen == [
        ("model", set(model_cores)),
        ("model", other_cores),
        ("model", other_cores),
        ("other", set(cores)),
        ("model", set(model_cores)),
    ]
