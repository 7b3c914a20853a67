"""The OpenAI-compatible HTTP front, driven by the official `openai` package (and curl) against a real stack: one
coordinator serving gRPC and HTTP in one process, API keys in a real Redis, on the module's tiny pair."""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import ssl
import subprocess
from dataclasses import dataclass

import openai
import pytest

from coordinator.api_keys import add_key
from coordinator.openai_api.server import bound_socket
from coordinator.redis_state import RedisKeys, connect_sync
from specdec.client import Client
from specdec.local_stack import ServiceProcess, start_service
from specdec.redis_server import RedisServer

pytestmark = pytest.mark.timeout(300)
MODEL = "target"  # the tiny pair's target directory's name
CHAT = [{"role": "system", "content": "w5 w6"}, {"role": "user", "content": "w7 w8 w9 w10"}]


@dataclass
class Front:
    """A coordinator with its HTTP API on, keys required: its process, a key, and a key limited to a request a
    minute."""

    service: ServiceProcess
    key: str
    limited_key: str


@pytest.fixture(scope="module")
def front(secure_replicas):
    with RedisServer() as redis:
        service = secure_replicas.start_coordinator(
            "coordinator-openai", "--http-address", "127.0.0.1:0", "--redis-url", redis.url, "--require-api-key"
        )
        with connect_sync(redis.url) as client:
            key = add_key(client, RedisKeys(), "openai-tests")
            limited_key = add_key(client, RedisKeys(), "openai-one-a-minute", requests_per_minute=1)
        yield Front(service, key, limited_key)
        service.stop()


@pytest.fixture(scope="module")
def client(front) -> openai.OpenAI:
    service, key = front.service, front.key
    return openai.OpenAI(base_url=f"http://127.0.0.1:{service.http_port}/v1", api_key=key, max_retries=0, timeout=60)


def speculation(usage) -> dict:
    return usage.model_extra["speculation"]


def test_chat_completion_whole_and_streamed_agree_with_usage(client):
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    [choice] = whole.choices
    assert whole.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content and choice.finish_reason == "length"
    assert whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens > 0
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    spec = speculation(whole.usage)
    assert spec["drafted_tokens"] >= spec["accepted_tokens"] >= 0 and spec["verify_passes"] >= 1
    assert spec["tokens_per_verify_pass"] >= 1  # the policy may decode plainly: then nothing is drafted
    drafted = max(spec["drafted_tokens"], 1)
    assert spec["acceptance_rate"] == pytest.approx(spec["accepted_tokens"] / drafted, abs=1e-5)

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_text_completion_whole_streamed_and_from_token_ids(client):
    whole = client.completions.create(model=MODEL, prompt="w3 w4 w5", max_tokens=10, temperature=0)
    assert whole.object == "text_completion" and whole.usage.completion_tokens == 10
    streamed = client.completions.create(model=MODEL, prompt="w3 w4 w5", max_tokens=10, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == whole.choices[0].text
    from_ids = client.completions.create(model=MODEL, prompt=[3, 4, 5], max_tokens=10, temperature=0)
    assert from_ids.choices[0].text == whole.choices[0].text


def test_stop_strings_end_the_completion_before_them(client):
    text = client.completions.create(model=MODEL, prompt="w9 w2", max_tokens=12, temperature=0).choices[0].text
    stop = text.split()[4]
    stopped = client.completions.create(model=MODEL, prompt="w9 w2", max_tokens=12, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(stop)]


def test_a_seed_reproduces_a_sampled_completion(client):
    def sample(seed: int) -> str:
        reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=1, seed=seed)
        return reply.choices[0].message.content

    assert sample(7) == sample(7)
    assert len({sample(seed) for seed in (1, 2, 3)}) > 1


def test_logprobs_and_top_logprobs_are_the_targets_in_both_apis(client, front):
    reply = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=10, temperature=0, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 10
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy: the most likely token
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
    assert "".join(entry.token for entry in content).replace(" ", "") == reply.choices[0].message.content.replace(
        " ", ""
    )
    service, key = front.service, front.key
    with Client(service.address, api_key=key) as grpc_client:
        grpc_reply = grpc_client.generate(
            messages=CHAT, max_new_tokens=10, temperature=0, logprobs=True, top_logprobs=3
        )
    # The same tokens; their log-probabilities may come from passes of other shapes (a block's length follows the
    # pre-draft's hit or miss), which round float32 sums differently in the last bits: a few ulps, not 1e-6 apart.
    assert [lp.logprob for lp in grpc_reply.logprobs] == pytest.approx([e.logprob for e in content], abs=1e-5)
    assert grpc_reply.text == reply.choices[0].message.content

    streamed = client.completions.create(
        model=MODEL, prompt="w3 w4 w5", max_tokens=6, temperature=0, logprobs=2, stream=True
    )
    token_logprobs = [lp for chunk in streamed for lp in chunk.choices[0].logprobs.token_logprobs]
    assert len(token_logprobs) == 6 and all(lp <= 0 for lp in token_logprobs)


CHAT_ERRORS = [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 2}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 100000}, "max_tokens"),
    ({"max_completion_tokens": 100000}, "max_completion_tokens"),
    ({"seed": -1}, "seed"),
    ({"stop": ["w1"] * 17}, "stop"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "w1"}]}, "messages"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"frequency_penalty": 99}, "frequency_penalty"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"extra_body": {"num_speculative_tokens": 99}}, "num_speculative_tokens"),
    ({"extra_body": {"draft_method": "magic"}}, "draft_method"),
    ({"extra_body": {"top_k": -5}}, "top_k"),
]


@pytest.mark.parametrize("fields, param", CHAT_ERRORS, ids=[param for _, param in CHAT_ERRORS])
def test_each_bad_chat_field_is_a_400_naming_it(client, fields, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**{"model": MODEL, "messages": CHAT, "max_tokens": 4, **fields})
    assert caught.value.status_code == 400 and caught.value.param == param
    assert caught.value.type == "invalid_request_error" and param in caught.value.message


@pytest.mark.parametrize(
    "fields, param",
    [({"prompt": ["w1", "w2"]}, "prompt"), ({"prompt": [9999]}, "prompt"), ({"logprobs": 21}, "logprobs")],
)
def test_each_bad_completion_field_is_a_400_naming_it(client, fields, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(**{"model": MODEL, "prompt": "w1", "max_tokens": 4, **fields})
    assert caught.value.param == param


def test_an_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-nothing", messages=CHAT, max_tokens=4)
    assert caught.value.param == "model"


def test_a_wrong_key_is_a_401(front):
    service = front.service
    stranger = openai.OpenAI(base_url=f"http://127.0.0.1:{service.http_port}/v1", api_key="sk-no", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        stranger.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"


def test_a_missing_key_is_a_401_in_openais_error_shape(front):
    service = front.service  # the openai package always sends a key: a bare request leaves it out
    connection = http.client.HTTPConnection("127.0.0.1", service.http_port, timeout=30)
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 4}
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    error = json.loads(response.read())["error"]
    assert response.status == 401 and set(error) == {"message", "type", "param", "code"}
    assert "missing API key" in error["message"] and error["type"] == "authentication_error"


def test_a_rate_limit_is_a_429(front):
    service = front.service
    limited = openai.OpenAI(
        base_url=f"http://127.0.0.1:{service.http_port}/v1", api_key=front.limited_key, max_retries=0
    )
    limited.completions.create(model=MODEL, prompt="w1", max_tokens=2)
    with pytest.raises(openai.RateLimitError) as caught:
        limited.completions.create(model=MODEL, prompt="w1", max_tokens=2)
    assert caught.value.status_code == 429 and "retry in" in caught.value.message


def test_models_health_and_metrics(client, front):
    assert [model.id for model in client.models.list()] == [MODEL]
    service = front.service
    connection = http.client.HTTPConnection("127.0.0.1", service.http_port, timeout=30)
    for path, expected in (("/health", b'"ok"'), ("/metrics", b"specdec_generated_tokens_total")):
        connection.request("GET", path)
        response = connection.getresponse()
        assert response.status == 200 and expected in response.read()


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_curl_streams_a_chat_completion_as_server_sent_events(front):
    service, key = front.service, front.key
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 8, "temperature": 0, "stream": True}
    output = subprocess.run(
        [
            "curl",
            "-sN",
            f"http://127.0.0.1:{service.http_port}/v1/chat/completions",
            "-H",
            f"Authorization: Bearer {key}",
            "-H",
            "Content-Type: application/json",
            "-d",
            json.dumps(body),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    events = [event for event in output.split("\n\n") if event]
    assert all(event.startswith("data: ") and "\n" not in event for event in events)
    payloads = [event.removeprefix("data: ") for event in events]
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(payload) for payload in payloads[:-1]]
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_front_in_its_own_process_passes_the_key_on(front, secure_replicas, tmp_path):
    service, key = front.service, front.key
    args = ["--coordinator", service.address, "--tokenizer", secure_replicas.target]
    process = start_service("http-front", "coordinator.openai_api", args, tmp_path)
    try:
        base_url = f"http://127.0.0.1:{process.port}/v1"
        own = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=60)
        direct = openai.OpenAI(base_url=f"http://127.0.0.1:{service.http_port}/v1", api_key=key, max_retries=0)
        asked = {"model": MODEL, "messages": CHAT, "max_tokens": 8, "temperature": 0}
        reply = own.chat.completions.create(**asked)
        assert reply.choices[0].message.content == direct.chat.completions.create(**asked).choices[0].message.content
        stranger = openai.OpenAI(base_url=base_url, api_key="sk-no", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            stranger.chat.completions.create(**asked)
        with pytest.raises(openai.BadRequestError) as caught:
            own.chat.completions.create(**{**asked, "max_tokens": 100000})
        assert caught.value.param == "max_tokens"
    finally:
        process.stop()


def test_the_front_sends_each_chunk_at_once():
    """Connections of the front's socket get TCP_NODELAY from asyncio (only a socket of protocol IPPROTO_TCP does):
    with Nagle's algorithm on, a stream's first chunk waited for the client's delayed ACK of the headers."""
    listening = bound_socket("127.0.0.1:0")
    try:
        client = socket.create_connection(listening.getsockname(), timeout=5)
        listening.setblocking(True)
        accepted, _ = listening.accept()
        assert accepted.proto == socket.IPPROTO_TCP
        accepted.close()
        client.close()
    finally:
        listening.close()


def test_the_http_front_speaks_tls_and_answers_504_past_its_deadline(secure_replicas):
    pki = secure_replicas.pki
    tls = ["--tls-cert", str(pki.server.cert), "--tls-key", str(pki.server.key)]
    service = secure_replicas.start_coordinator(
        "coordinator-openai-tls", "--http-address", "127.0.0.1:0", "--http-request-timeout-s", "0.02", *tls
    )
    try:
        context = ssl.create_default_context(cafile=str(pki.ca.cert))
        connection = http.client.HTTPSConnection("localhost", service.http_port, context=context, timeout=30)
        connection.request("GET", "/v1/models")
        response = connection.getresponse()
        assert response.status == 200 and json.loads(response.read())["data"][0]["id"] == MODEL
        body = {"model": MODEL, "prompt": "w1 w2", "max_tokens": 200, "temperature": 0}
        connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        error = json.loads(response.read())["error"]
        assert response.status == 504 and error["type"] == "timeout_error" and "deadline" in error["message"]
    finally:
        service.stop()
