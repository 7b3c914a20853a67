"""The draft process dies mid-generation: the request finishes by plain decoding, still exact, and the
coordinator goes back to the drafter once it serves again."""

from __future__ import annotations

import signal
import time

from specdec.client import Client
from specdec.decoding.reference_loop import target_only_generate
from specdec.engine.model_runtime import LoadedModel, ModelSettings
from specdec.local_stack import LocalStack, start_service
from specdec.sampling.rules import SamplingParams

PROMPT = [9, 4, 33, 12]
MAX_NEW = 200


def test_killing_the_drafter_mid_stream_keeps_the_output_exact(tiny_pair_dirs):
    target_dir, draft_dir = tiny_pair_dirs
    expected = target_only_generate(
        LoadedModel.load(ModelSettings(str(target_dir))), PROMPT, SamplingParams(), MAX_NEW
    ).token_ids
    # Fixed γ: on the tiny pair adaptive γ would rightly not draft at all, and this test needs the drafter in use.
    with (
        LocalStack(str(target_dir), str(draft_dir), coordinator_args=["--no-adaptive-gamma"]) as stack,
        Client(stack.address, timeout_s=120) as client,
    ):
        draft = stack.services["draft"]
        stream = client.stream(PROMPT, max_new_tokens=MAX_NEW, num_speculative_tokens=1, include_stats=True)
        chunks = [next(stream)]
        draft.process.send_signal(signal.SIGKILL)
        draft.process.wait(10)
        chunks.extend(stream)
        assert [t for c in chunks for t in c.token_ids] == expected
        assert chunks[-1].finish_reason != 0

        plain = client.generate(PROMPT, max_new_tokens=8, include_stats=True)  # drafter still down
        assert list(plain.token_ids) == expected[:8] and plain.stats.drafted_tokens == 0

        port = draft.port
        stack.services["draft"] = start_service(
            "draft-restarted",
            "draft_service",
            ["--address", f"127.0.0.1:{port}", "--model", str(draft_dir)],
            stack.log_dir,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the coordinator probes the drafter and takes it back
            reply = client.generate(PROMPT, max_new_tokens=8, include_stats=True)
            if reply.stats.drafted_tokens > 0:
                break
            time.sleep(0.5)
        assert reply.stats.drafted_tokens > 0 and list(reply.token_ids) == expected[:8]
