"""The contenders of the speedup benchmark: one call generates one completion and says how it went.

Every contender takes a prompt as token ids, a temperature, a seed and a token budget, and returns the
generated ids (prompt excluded, EOS included when produced), the wall time of the whole call (prefill
included) and its draft counts. In-process contenders run in this process; `on_cores` pins a contender to
chosen cores and torch threads for its calls. The gRPC contenders talk to a running LocalStack whose services
each got their own share of the cores.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from benchmarks.stack_runs import timed_generate
from specdec.client import Client
from specdec.decoding.reference_loop import speculative_generate, target_only_generate
from specdec.engine.model_runtime import LoadedModel
from specdec.sampling.rules import SamplingParams, SamplingRule


@dataclass
class RunOutput:
    """One generated completion."""

    token_ids: list[int]
    seconds: float
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    predraft_attempts: int = 0
    predraft_hits: int = 0


Contender = Callable[[Sequence[int], float, int, int], RunOutput]  # (prompt_ids, temperature, seed, max_new_tokens)


@contextlib.contextmanager
def pinned(cores: set[int] | None, threads: int) -> Iterator[None]:
    """This thread on `cores` (all it may use when None) with `threads` torch threads, restored on exit.

    Threads are set before pinning and restored after unpinning, so worker threads torch starts for a higher
    count inherit the wide affinity, not a narrowed one; with 1 thread torch computes on the calling thread.
    """
    previous_cores, previous_threads = os.sched_getaffinity(0), torch.get_num_threads()
    torch.set_num_threads(threads)
    os.sched_setaffinity(0, cores or previous_cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, previous_cores)
        torch.set_num_threads(previous_threads)


def on_cores(run: Contender, cores: set[int] | None, threads: int) -> Contender:
    """`run` with this thread pinned to `cores` on `threads` torch threads during each call (see `pinned`)."""

    def pinned_run(prompt_ids, temperature, seed, max_new_tokens):
        with pinned(cores, threads):
            return run(prompt_ids, temperature, seed, max_new_tokens)

    return pinned_run


def _sampling(temperature: float, seed: int) -> SamplingParams:
    """A seeded request's settings under the rule the stack gives every seeded request (coupled)."""
    return SamplingParams(temperature=temperature, top_k=0, top_p=1.0, seed=seed, rule=SamplingRule.COUPLED)


def _hf_kwargs(
    model: LoadedModel, prompt_ids: Sequence[int], temperature: float, seed: int, max_new_tokens: int
) -> dict:
    """generate() arguments matching SamplingParams(temperature, top_k=0, top_p=1): plain softmax sampling."""
    input_ids = torch.tensor([list(prompt_ids)])  # [1, T]
    kwargs = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "max_new_tokens": max_new_tokens,
        "use_cache": True,
        "pad_token_id": model.tokenizer.pad_token_id or min(model.eos_token_ids, default=0),
    }
    if temperature > 0:
        torch.manual_seed(seed)  # HF samples from torch's global RNG
        kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
    return kwargs


def hf_target_only(target: LoadedModel) -> Contender:
    """HF `generate` with the target alone (greedy or multinomial sampling, KV cache on)."""

    def run(prompt_ids, temperature, seed, max_new_tokens):
        kwargs = _hf_kwargs(target, prompt_ids, temperature, seed, max_new_tokens)
        started = time.perf_counter()
        with torch.inference_mode():
            output = target.model.generate(**kwargs)  # [1, T + new]
        seconds = time.perf_counter() - started
        return RunOutput(output[0, len(prompt_ids) :].tolist(), seconds)

    return run


def own_target_only(target: LoadedModel) -> Contender:
    """The project's plain decoding path (`target_only_generate`)."""

    def run(prompt_ids, temperature, seed, max_new_tokens):
        started = time.perf_counter()
        result = target_only_generate(target, prompt_ids, _sampling(temperature, seed), max_new_tokens)
        return RunOutput(result.token_ids, time.perf_counter() - started, rounds=result.stats.rounds)

    return run


@dataclass
class _Acceptance:
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0


@contextlib.contextmanager
def _counting_hf_acceptance() -> Iterator[_Acceptance]:
    """Counts HF assisted generation's drafted and accepted tokens.

    transformers reports them to nobody but `update_candidate_strategy(input_ids, scores, num_matches)`,
    called once per round with the target's scores for the candidates plus one, so this observes that call.
    """
    from transformers.generation.candidate_generator import AssistedCandidateGenerator

    counts = _Acceptance()
    original = AssistedCandidateGenerator.update_candidate_strategy

    def observed(self, input_ids, scores, num_matches):
        counts.rounds += 1
        counts.drafted += scores.shape[1] - 1  # scores: [1, candidates + 1, V]
        counts.accepted += int(num_matches)
        return original(self, input_ids, scores, num_matches)

    AssistedCandidateGenerator.update_candidate_strategy = observed
    try:
        yield counts
    finally:
        AssistedCandidateGenerator.update_candidate_strategy = original


def hf_assisted(target: LoadedModel, draft: LoadedModel, gamma: int) -> Contender:
    """HF assisted generation, `generate(assistant_model=draft)`, drafting a constant γ tokens per round."""

    def run(prompt_ids, temperature, seed, max_new_tokens):
        config = draft.model.generation_config  # read by transformers when it builds the candidate generator
        config.num_assistant_tokens = gamma
        config.num_assistant_tokens_schedule = "constant"
        config.assistant_confidence_threshold = 0.0  # 0 turns off the early stop on low draft confidence
        kwargs = _hf_kwargs(target, prompt_ids, temperature, seed, max_new_tokens)
        with _counting_hf_acceptance() as counts:
            started = time.perf_counter()
            with torch.inference_mode():
                output = target.model.generate(**kwargs, assistant_model=draft.model)  # [1, T + new]
            seconds = time.perf_counter() - started
        return RunOutput(output[0, len(prompt_ids) :].tolist(), seconds, counts.drafted, counts.accepted, counts.rounds)

    return run


def reference_loop(target: LoadedModel, draft: LoadedModel, gamma: int) -> Contender:
    """The project's in-process speculative loop (`speculative_generate`)."""

    def run(prompt_ids, temperature, seed, max_new_tokens):
        started = time.perf_counter()
        result = speculative_generate(target, draft, prompt_ids, gamma, _sampling(temperature, seed), max_new_tokens)
        stats = result.stats
        return RunOutput(result.token_ids, time.perf_counter() - started, stats.drafted, stats.accepted, stats.rounds)

    return run


def grpc_stack(client: Client, gamma: int) -> Contender:
    """A request to a running coordinator (sequential or overlapped rounds, as that coordinator was started)."""

    def run(prompt_ids, temperature, seed, max_new_tokens):
        request = timed_generate(
            client,
            list(prompt_ids),
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=0,
            seed=seed,
            num_speculative_tokens=gamma,
        )
        return RunOutput(
            request.token_ids,
            request.seconds,
            request.drafted,
            request.accepted,
            request.rounds,
            request.predraft_attempts,
            request.predraft_hits,
        )

    return run
