"""A session's calls on one stream (CallStream) answer as the unary calls do: responses, statuses, deadlines."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from specdec.decoding.reference_loop import target_only_generate
from specdec.sampling.rules import SamplingParams
from specdec.serving.call_stream import CallStreamServer, StreamedMethod
from specdec.serving.call_stream_client import CallStreamClient
from specdec.serving.grpc_errors import ErrorMappingInterceptor
from specdec.serving.grpc_telemetry import ServerTelemetryInterceptor
from specdec.serving.wire import call_deadline, sampling_to_proto
from specdec.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from verify_service.service import VerifyService
from verify_service.servicer import VerifierServicer
from verify_service.settings import VerifySettings

VERIFIER = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"]
PROMPT = [5, 9, 14, 3]


def open_request(session_id: str) -> verifier_pb2.OpenVerifySessionRequest:
    return verifier_pb2.OpenVerifySessionRequest(
        session_id=session_id, prompt_token_ids=PROMPT, sampling=sampling_to_proto(SamplingParams())
    )


async def with_verifier(target, scenario):
    """Runs scenario(stub) against a real verify servicer on a loopback server."""
    servicer = VerifierServicer(VerifyService(VerifySettings(), target))
    server = grpc.aio.server(interceptors=[ServerTelemetryInterceptor(), ErrorMappingInterceptor()])
    verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            return await scenario(verifier_pb2_grpc.VerifierStub(channel))
    finally:
        await server.stop(0)
        servicer.close()


def test_streamed_calls_answer_as_unary_calls_do(tiny_pair):
    target, _ = tiny_pair
    reference = target_only_generate(target, PROMPT, SamplingParams(), 4).token_ids

    async def scenario(stub):
        stream = CallStreamClient(stub.CallStream, VERIFIER)
        opened = await stream.call("OpenSession", open_request("s"), timeout=30)
        unary = await stub.OpenSession(open_request("u"), timeout=30)
        rounds = await asyncio.gather(  # concurrent calls on one stream, each answered by its id
            stream.call("Verify", verifier_pb2.VerifyRequest(session_id="s", base_len=4, draft_token_ids=[]), 30),
            stub.Verify(verifier_pb2.VerifyRequest(session_id="u", base_len=4, draft_token_ids=[]), timeout=30),
        )
        stream.cancel()
        return opened, unary, rounds

    opened, unary, (streamed, plain) = asyncio.run(with_verifier(target, scenario))
    assert opened.session_len == unary.session_len == len(PROMPT)
    assert streamed.next_token_id == plain.next_token_id == reference[0]
    assert streamed.session_len == plain.session_len == len(PROMPT) + 1


def test_errors_come_back_with_the_status_a_unary_call_gets(tiny_pair):
    target, _ = tiny_pair

    async def status_of(call) -> grpc.StatusCode:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await call
        return raised.value.code()

    async def scenario(stub):
        stream = CallStreamClient(stub.CallStream, VERIFIER)
        await stream.call("OpenSession", open_request("s"), timeout=30)
        bad_token = verifier_pb2.VerifyRequest(session_id="s", base_len=4, draft_token_ids=[10**6])
        stale = verifier_pb2.VerifyRequest(session_id="s", base_len=40, draft_token_ids=[1])
        missing = verifier_pb2.VerifyRequest(session_id="nobody", base_len=4, draft_token_ids=[1])
        codes = [await status_of(stream.call("Verify", request, 30)) for request in (bad_token, stale, missing)]
        unary = [await status_of(stub.Verify(request, timeout=30)) for request in (bad_token, stale, missing)]
        await stream.call("Verify", verifier_pb2.VerifyRequest(session_id="s", base_len=4), 30)
        waiting = verifier_pb2.VerifyNextRequest(session_id="s", after_base_len=50, plain_otherwise=True)
        late = await status_of(stream.call("VerifyNext", waiting, timeout=0.2))  # waits for a round that never runs
        after_late = await stream.call("Verify", verifier_pb2.VerifyRequest(session_id="s", base_len=5), 30)
        pending = asyncio.ensure_future(stream.call("VerifyNext", waiting, timeout=30))
        await asyncio.sleep(0.2)
        stream.cancel()
        ended = await status_of(pending)
        return codes, unary, late, after_late, ended

    codes, unary, late, after_late, ended = asyncio.run(with_verifier(target, scenario))
    expected = [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND]
    assert codes == unary == expected
    assert late == grpc.StatusCode.DEADLINE_EXCEEDED
    assert after_late.session_len == len(PROMPT) + 2  # the stream serves on after a call's deadline
    assert ended == grpc.StatusCode.UNAVAILABLE  # a call on a stream that ended


class StreamContext:
    """A call stream's context as grpc.aio gives it to the server: the stream itself set no deadline."""

    def time_remaining(self) -> None:
        return None


def test_a_streamed_call_carries_its_own_deadline_to_the_method():
    seen: list[float | None] = []

    async def info(request, context):
        seen.append(call_deadline(context))
        return common_pb2.ServiceInfo()

    async def scenario() -> float:
        server = CallStreamServer({"/t/Info": StreamedMethod(common_pb2.InfoRequest, info)})
        for timeout_s in (0.0, 5.0):
            call = common_pb2.StreamedCall(call_id=1, method="/t/Info", timeout_s=timeout_s)
            assert (await server.reply(call, StreamContext())).status_code == 0
        return asyncio.get_running_loop().time()

    after = asyncio.run(scenario())
    assert seen[0] is None  # no timeout: no deadline, as a unary call without one
    assert 0 < seen[1] - after <= 5.0  # the wait for KV blocks of an open ends before it, as for a unary call
