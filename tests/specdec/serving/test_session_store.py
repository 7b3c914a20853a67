"""Sessions a replica holds: idle expiry, in the store and through real draft and verify services."""

from __future__ import annotations

import time

import grpc
import pytest

from specdec.local_stack import start_service
from specdec.serving.session_store import SessionStore, close_idle_sessions
from specdec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc


def test_only_sessions_no_call_touched_for_the_ttl_expire():
    store: SessionStore[list] = SessionStore(4, len)
    store.add("old", [1, 2, 3])
    store.add("used", [1])
    time.sleep(0.2)
    store.get("used")  # a call touched it
    closed: list[str] = []
    assert close_idle_sessions(store, 0.15, lambda sid: closed.append(sid) or store.close(sid)) == 1
    assert closed == ["old"] and list(store) == ["used"]
    assert close_idle_sessions(store, 60, store.close) == 0 and len(store) == 1
    assert store.idle(0) == [("used", pytest.approx(0, abs=5))]


@pytest.fixture(scope="module")
def expiring_services(tiny_pair_dirs, tmp_path_factory):
    target_dir, draft_dir = tiny_pair_dirs
    log_dir = tmp_path_factory.mktemp("expiring")
    ttl = ["--session-idle-ttl-s", "1"]
    draft = start_service("draft", "draft_service", ["--model", str(draft_dir), *ttl], log_dir)
    verify = start_service("verify", "verify_service", ["--model", str(target_dir), *ttl], log_dir)
    yield draft, verify
    draft.stop()
    verify.stop()


def test_a_session_left_idle_past_the_ttl_is_closed_and_its_kv_freed(expiring_services):
    draft, verify = expiring_services
    prompt = [5, 9, 2, 7]
    with grpc.insecure_channel(draft.address) as draft_channel, grpc.insecure_channel(verify.address) as verify_channel:
        drafter = drafter_pb2_grpc.DrafterStub(draft_channel)
        verifier = verifier_pb2_grpc.VerifierStub(verify_channel)
        drafter.OpenSession(
            drafter_pb2.OpenDraftSessionRequest(session_id="left", prompt_token_ids=prompt, num_lanes=2), timeout=30
        )
        verifier.OpenSession(
            verifier_pb2.OpenVerifySessionRequest(session_id="left", prompt_token_ids=prompt), timeout=30
        )
        infos = [stub.Info(common_pb2.InfoRequest(), timeout=10) for stub in (drafter, verifier)]
        assert [i.active_sessions for i in infos] == [1, 1] and all(i.kv_cache_tokens > 0 for i in infos)
        for _ in range(100):  # the sweep runs every ttl / 4
            infos = [stub.Info(common_pb2.InfoRequest(), timeout=10) for stub in (drafter, verifier)]
            if all(i.active_sessions == 0 for i in infos):
                break
            time.sleep(0.1)
        assert [(i.active_sessions, i.kv_cache_tokens) for i in infos] == [(0, 0), (0, 0)]
        with pytest.raises(grpc.RpcError) as raised:
            verifier.Verify(verifier_pb2.VerifyRequest(session_id="left", base_len=len(prompt)), timeout=10)
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    for service in (draft, verify):
        assert "session 'left' expired: no call for" in service.log_path.read_text()
