"""One request's draft -> verify -> commit rounds across a draft and a verify replica.

Sequential mode: Propose(block k) then Verify(block k). Overlapped mode: while Verify(block k) runs, the
drafter already drafts block k+1 under the guess "all of block k accepted, and the bonus token is the
draft's own next token". A verdict that matches the guess sends the pre-drafted block straight to the
verifier; any other verdict discards it, and the next Propose's base_len rolls the drafter back.
Draws are keyed by (seed, position), so both modes commit the same tokens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc

from coordinator.replicas import Replica
from coordinator.text_stream import Chunk, TextStream
from specdec.errors import DownstreamUnavailableError
from specdec.sampling import SamplingParams
from specdec.speculation_stats import SpeculationStats
from specdec.v1 import common_pb2, drafter_pb2, verifier_pb2
from specdec.wire import sampling_to_proto

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationPlan:
    """A validated request, ready to run."""

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams
    gamma: int  # 0 = plain target decoding through the verifier
    draft_method: int  # common_pb2.DraftMethod
    overlap: bool


@dataclass
class RequestStats(SpeculationStats):
    """Speculation counts plus where the time went (ns) and how pre-drafting fared."""

    draft_ns: int = 0
    verify_ns: int = 0
    sampling_ns: int = 0
    wire_ns: int = 0
    prefill_ns: int = 0
    total_ns: int = 0
    predraft_attempts: int = 0
    predraft_hits: int = 0
    round_timeline: list[tuple[str, int, int]] = field(default_factory=list)  # (stage, start_ns, end_ns)


@dataclass
class DraftBlock:
    """Drafted tokens with their q (None = one-hot) as returned by the drafter."""

    token_ids: list[int]
    probs: common_pb2.ProbabilityMatrix | None

    def tail(self) -> DraftBlock:
        """The block without its first token (the bonus guess of a pre-draft)."""
        probs = None
        if self.probs is not None and self.probs.rows:
            row_bytes = self.probs.vocab_size * 4
            probs = common_pb2.ProbabilityMatrix(rows=self.probs.rows - 1, vocab_size=self.probs.vocab_size,
                                                 float32_data=self.probs.float32_data[row_bytes:])
        return DraftBlock(self.token_ids[1:], probs)


class Generation:
    """Runs one request on one draft and one verify replica, yielding a Chunk per committed round."""

    def __init__(self, plan: GenerationPlan, draft: Replica | None, verify: Replica, text: TextStream,
                 call_timeout_s: float):
        self.plan = plan
        self.draft = draft if plan.gamma > 0 else None
        self.verify = verify
        self.text = text
        self.timeout = call_timeout_s
        self.stats = RequestStats()
        self.committed: list[int] = list(plan.prompt_ids)
        self.draft_synced_len = len(plan.prompt_ids)  # committed prefix the drafter is known to hold
        self._started_ns = time.perf_counter_ns()

    def elapsed_ns(self) -> int:
        """Time since the request started."""
        return time.perf_counter_ns() - self._started_ns

    @property
    def remaining(self) -> int:
        return self.plan.max_new_tokens - (len(self.committed) - len(self.plan.prompt_ids))

    async def chunks(self) -> AsyncIterator[Chunk]:
        """Opens both sessions, runs rounds until a stop rule fires, and always closes the sessions."""
        try:
            await self._open_sessions()
            async for chunk in self._rounds():
                yield chunk
                if chunk.finish_reason:
                    return
        finally:
            self.stats.total_ns = self.elapsed_ns()
            await asyncio.shield(self._close_sessions())

    async def _open_sessions(self) -> None:
        started = time.perf_counter_ns()
        sampling = sampling_to_proto(self.plan.params)
        calls = [self._call(self.verify, "OpenSession", verifier_pb2.OpenVerifySessionRequest(
            session_id=self.plan.request_id, prompt_token_ids=self.plan.prompt_ids, sampling=sampling))]
        if self.draft is not None:
            calls.append(self._call(self.draft, "OpenSession", drafter_pb2.OpenDraftSessionRequest(
                session_id=self.plan.request_id, prompt_token_ids=self.plan.prompt_ids, sampling=sampling,
                draft_method=self.plan.draft_method)))
        await asyncio.gather(*calls)
        self.stats.prefill_ns = time.perf_counter_ns() - started

    async def _close_sessions(self) -> None:
        request = common_pb2.CloseSessionRequest(session_id=self.plan.request_id)
        replicas = [r for r in (self.verify, self.draft) if r is not None]
        results = await asyncio.gather(*(r.stub.CloseSession(request, timeout=self.timeout) for r in replicas),
                                       return_exceptions=True)
        for replica, result in zip(replicas, results):
            if isinstance(result, Exception):
                log.warning("request %s: closing its session on %s failed: %s", self.plan.request_id,
                            replica.address, result)

    async def _call(self, replica: Replica, method: str, request):
        """One internal call with a deadline; a replica that is gone becomes DownstreamUnavailableError."""
        try:
            return await getattr(replica.stub, method)(request, timeout=self.timeout)
        except grpc.aio.AioRpcError as error:
            if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise DownstreamUnavailableError(f"{replica.address} {method}: {error.code().name}: "
                                                 f"{error.details()}") from error
            raise

    def _block_size(self, tokens_before: int) -> int:
        """γ for a block that starts after tokens_before more commits: never draft past the token budget."""
        return max(0, min(self.plan.gamma, self.remaining - tokens_before - 1))

    async def _propose(self, base_len: int, appended: Sequence[int], num_tokens: int) -> DraftBlock:
        started = time.perf_counter_ns()
        reply = await self._call(self.draft, "Propose", drafter_pb2.ProposeRequest(
            session_id=self.plan.request_id, base_len=base_len, appended_token_ids=appended,
            num_speculative_tokens=num_tokens))
        ended = time.perf_counter_ns()
        self.stats.draft_ns += reply.draft_ns
        self.stats.wire_ns += (ended - started) - reply.draft_ns
        self.stats.round_timeline.append(("draft", started - self._started_ns, ended - self._started_ns))
        probs = reply.draft_probs if reply.HasField("draft_probs") and reply.draft_probs.rows else None
        return DraftBlock(list(reply.draft_token_ids), probs)

    async def _sync_and_propose(self) -> DraftBlock:
        """Propose after syncing the drafter to the committed sequence (base_len + what it has not seen)."""
        num_tokens = self._block_size(0)
        if self.draft is None or num_tokens == 0:
            return DraftBlock([], None)
        block = await self._propose(self.draft_synced_len, self.committed[self.draft_synced_len:], num_tokens)
        self.draft_synced_len = len(self.committed)
        return block

    async def _verify(self, block: DraftBlock) -> verifier_pb2.VerifyResponse:
        started = time.perf_counter_ns()
        reply = await self._call(self.verify, "Verify", verifier_pb2.VerifyRequest(
            session_id=self.plan.request_id, base_len=len(self.committed), draft_token_ids=block.token_ids,
            draft_probs=block.probs))
        ended = time.perf_counter_ns()
        self.stats.verify_ns += reply.forward_ns
        self.stats.sampling_ns += reply.sampling_ns
        self.stats.wire_ns += (ended - started) - reply.forward_ns - reply.sampling_ns
        self.stats.round_timeline.append(("verify", started - self._started_ns, ended - self._started_ns))
        return reply

    async def _rounds(self) -> AsyncIterator[Chunk]:
        block = await self._sync_and_propose()
        while True:
            predraft_size = self._block_size(len(block.token_ids) + 1) if self.plan.overlap else 0
            predraft = None
            if self.draft is not None and block.token_ids and predraft_size > 0:
                # Guess: all of block k accepted; the drafter drafts its own bonus guess, then block k+1.
                predraft = asyncio.ensure_future(self._propose(
                    len(self.committed) + len(block.token_ids), [], predraft_size + 1))
                self.stats.predraft_attempts += 1
            try:
                verdict = await self._verify(block)
            except BaseException:
                if predraft is not None:
                    predraft.cancel()
                raise
            new_tokens = [*verdict.accepted_token_ids, verdict.next_token_id]
            base_len = len(self.committed)
            self.stats.record(len(block.token_ids), len(verdict.accepted_token_ids))
            self.committed.extend(new_tokens)
            # The drafter already holds the accepted prefix of its block.
            self.draft_synced_len = base_len + len(verdict.accepted_token_ids)
            chunk = self.text.add(new_tokens)
            yield chunk
            if chunk.finish_reason or self.remaining <= 0:
                if predraft is not None:
                    await asyncio.gather(predraft, return_exceptions=True)
                return
            if predraft is not None:
                guessed = await predraft
                all_accepted = len(verdict.accepted_token_ids) == len(block.token_ids)
                if all_accepted and guessed.token_ids[:1] == [verdict.next_token_id]:
                    self.stats.predraft_hits += 1
                    self.draft_synced_len = len(self.committed)
                    block = guessed.tail()
                    if block.token_ids:
                        continue
            block = await self._sync_and_propose()
