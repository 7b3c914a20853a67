"""A dead verify replica costs at most one request when another is configured.

Held to: a coordinator given two verify replicas (`--verify-replicas A,B`) whose first, A, is SIGKILLed answers
at least 9 of the next 10 sequential requests, each with the same tokens as before the kill (greedy).
"""

from __future__ import annotations

import grpc
import pytest
from harness import TARGET_DIR, Coordinator, request

REQUESTS = 10
MAX_FAILURES = 1


@pytest.fixture(scope="module")
def two_verifiers(shared_stack):
    """A verify replica of its own (A, to be killed) and the shared one (B), behind a coordinator of their own."""
    doomed = shared_stack.group.serve("verify", "--model", str(TARGET_DIR), name="verify-doomed")
    process = shared_stack.group.serve(
        "coordinator",
        *shared_stack.coordinator_args(verify=f"{doomed.address},{shared_stack.verify.address}", redis=False),
        name="coordinator-two-verifiers",
    )
    coordinator = Coordinator(process.address, process)
    yield doomed, coordinator
    coordinator.close()
    process.kill()
    doomed.kill()


def test_a_sigkilled_verify_replica_costs_at_most_one_request(two_verifiers):
    doomed, coordinator = two_verifiers
    assert len(coordinator.info().verify_replicas) == 2
    messages = [request([11, 12, 13, i], 12, num_speculative_tokens=4) for i in range(REQUESTS)]
    before = [list(coordinator.generate(m).token_ids) for m in messages[:2]]  # the stack works, and answers these
    doomed.kill()
    outcomes = []
    for message in messages:
        try:
            outcomes.append(list(coordinator.generate(message, timeout_s=60).token_ids))
        except grpc.RpcError as error:
            outcomes.append(error)
    failures = [o for o in outcomes if isinstance(o, grpc.RpcError)]
    assert len(failures) <= MAX_FAILURES, f"{len(failures)} of {REQUESTS} failed: {[f.code() for f in failures]}"
    for index, tokens in enumerate(outcomes[:2]):
        if not isinstance(tokens, grpc.RpcError):
            assert tokens == before[index]
