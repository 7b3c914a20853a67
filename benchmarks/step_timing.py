"""Per-step cost of the project's runtime against a bare forward pass, and c = draft step / target step.

All timings are batch 1 with a warm KV cache holding a prompt: one new token (a decode step), or γ+1 new
tokens (a verify block). After each timed call the cache is cropped back, so every sample sees the same
context length. Three ways of running one decode step are timed, interleaved so drift hits them alike:

- bare forward: `model(input_ids=..., cache=..., use_cache=True)` inside `torch.inference_mode()`;
- runtime forward: `LoadedModel.forward` (what c is measured with);
- session step: `KVSession.extend([token], score_previous=False)`, the call the project's decoding loops
  make per token (drafting and plain decoding).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
from transformers import DynamicCache

from specdec.engine.kv.session import KVSession
from specdec.engine.model_runtime import LoadedModel


def _median_ms(samples_ns: list[int]) -> float:
    return statistics.median(samples_ns) / 1e6


def _timed(call: Callable[[], object]) -> int:
    started = time.perf_counter_ns()
    call()
    return time.perf_counter_ns() - started


def step_times(
    model: LoadedModel, context_ids: Sequence[int], repeats: int, verify_tokens: int, warmup: int = 3
) -> dict[str, float]:
    """Median milliseconds of one decode step three ways, and of scoring a verify_tokens block."""
    context = list(context_ids)
    cache = DynamicCache(config=model.model.config)  # the bare transformers path: its own cache type
    with torch.inference_mode():
        model.model(input_ids=torch.tensor([context[:-1]]), cache=cache, use_cache=True)
    cached = len(context) - 1
    one = torch.tensor([context[-1:]])  # [1, 1]
    block = torch.tensor([(context * verify_tokens)[:verify_tokens]])  # [1, γ+1]

    runtime_cache = model.new_cache()  # the runtime's own cache type (packed buffers or DynamicCache)
    model.forward(torch.tensor([context[:-1]]), runtime_cache)

    def crop() -> None:
        cache.crop(cached - cache.get_seq_length())  # a negative count: drop what the timed call added

    def crop_runtime() -> None:
        runtime_cache.crop(cached - runtime_cache.get_seq_length())

    def bare() -> None:
        with torch.inference_mode():
            model.model(input_ids=one, cache=cache, use_cache=True)

    session = KVSession(model, context[:-1])
    session.prefill()
    session.extend([context[-1]], score_previous=False)  # steady state: every token cached
    session_len = len(session)

    def session_step() -> None:
        session.extend([context[-1]], score_previous=False)

    def reset_session() -> None:
        session.truncate(session_len)

    calls = {
        "bare_forward_ms": (bare, crop),
        "runtime_forward_ms": (lambda: model.forward(one, runtime_cache), crop_runtime),
        "session_step_ms": (session_step, reset_session),
        "verify_block_ms": (lambda: model.forward(block, runtime_cache), crop_runtime),
    }
    names = list(calls)
    samples: dict[str, list[int]] = {name: [] for name in names}
    for i in range(warmup + repeats):
        for name in names[i % len(names) :] + names[: i % len(names)]:  # rotate: no call always runs first
            call, reset = calls[name]
            elapsed = _timed(call)
            reset()
            if i >= warmup:
                samples[name].append(elapsed)
    return {name: _median_ms(values) for name, values in samples.items()}


def measure_pair(
    target: LoadedModel,
    draft: LoadedModel,
    context_ids: Sequence[int],
    threads: int,
    gamma: int,
    target_repeats: int,
    draft_repeats: int,
) -> dict:
    """Step times of both models at `threads` intra-op threads, their runtime overhead, and c."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        result = {
            "threads": threads,
            "target": step_times(target, context_ids, target_repeats, gamma + 1),
            "draft": step_times(draft, context_ids, draft_repeats, gamma + 1),
        }
    finally:
        torch.set_num_threads(previous)
    for side in ("target", "draft"):
        times = result[side]
        bare = times["bare_forward_ms"]
        times["runtime_overhead_ms"] = times["runtime_forward_ms"] - bare
        times["runtime_overhead_pct"] = 100 * times["runtime_overhead_ms"] / bare
        times["session_overhead_ms"] = times["session_step_ms"] - bare
        times["session_overhead_pct"] = 100 * times["session_overhead_ms"] / bare
    result["c"] = result["draft"]["runtime_forward_ms"] / result["target"]["runtime_forward_ms"]
    return result
