"""The Coordinator's replies as OpenAI response bodies: chat completions and their chunks, text completions, usage
with a `speculation` object, and log-probabilities in each endpoint's format."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from specdec.v1 import common_pb2, coordinator_pb2

FINISH_REASONS = {  # the OpenAI API knows no "eos": the model stopped by itself
    coordinator_pb2.FINISH_REASON_STOP: "stop",
    coordinator_pb2.FINISH_REASON_EOS: "stop",
    coordinator_pb2.FINISH_REASON_LENGTH: "length",
    coordinator_pb2.FINISH_REASON_CONSTRAINT_DEAD_END: "stop",  # the response_format allows nothing more
}


def usage(stats: coordinator_pb2.GenerationStats, completion_tokens: int) -> dict:
    """OpenAI's usage, plus what speculation did for the request."""
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": stats.prompt_tokens + completion_tokens,
        "speculation": {
            "drafted_tokens": stats.drafted_tokens,
            "accepted_tokens": stats.accepted_tokens,
            "acceptance_rate": round(stats.acceptance_rate, 6),
            "verify_passes": stats.rounds,
            "tokens_per_verify_pass": round(stats.mean_accepted_length, 6),
        },
    }


@dataclass
class Completion:
    """One request's reply as the replies stream in: what to put in each OpenAI body."""

    kind: str  # "chat" or "text"
    model: str
    request_id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    completion_tokens: int = 0
    text_offset: int = 0  # text completions' logprobs: where the next token's text starts
    chunks: int = 0  # streamed so far (the first chat chunk names the role)

    @property
    def id(self) -> str:
        return f"{'chatcmpl' if self.kind == 'chat' else 'cmpl'}-{self.request_id}"

    def _body(self, object_name: str, choices: list) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model, "choices": choices}

    def whole(self, reply: coordinator_pb2.GenerateResponse, tokenizer: PreTrainedTokenizerBase | None) -> dict:
        """A non-streamed completion."""
        self.request_id = reply.request_id
        choice = {"index": 0, "finish_reason": FINISH_REASONS.get(reply.finish_reason)}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": reply.text}
        else:
            choice["text"] = reply.text
        choice["logprobs"] = self._logprobs(reply.logprobs, tokenizer) if tokenizer is not None else None
        body = self._body("chat.completion" if self.kind == "chat" else "text_completion", [choice])
        body["usage"] = usage(reply.stats, len(reply.token_ids))
        return body

    def chunk(
        self,
        reply: coordinator_pb2.GenerateStreamResponse,
        tokenizer: PreTrainedTokenizerBase | None,
        include_usage: bool,
    ) -> dict:
        """A streamed chunk of one round's tokens (the first chat chunk names the role)."""
        self.request_id = reply.request_id
        self.completion_tokens += len(reply.token_ids)
        first, self.chunks = self.chunks == 0, self.chunks + 1
        choice: dict = {"index": 0}
        if self.kind == "chat":
            choice["delta"] = {"role": "assistant", "content": reply.text} if first else {"content": reply.text}
        else:
            choice["text"] = reply.text
        choice["logprobs"] = self._logprobs(reply.logprobs, tokenizer) if tokenizer is not None else None
        choice["finish_reason"] = FINISH_REASONS.get(reply.finish_reason)
        body = self._body("chat.completion.chunk" if self.kind == "chat" else "text_completion", [choice])
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, stats: coordinator_pb2.GenerationStats) -> dict:
        """The last chunk of a stream that asked for usage: no choices."""
        body = self._body("chat.completion.chunk" if self.kind == "chat" else "text_completion", [])
        body["usage"] = usage(stats, self.completion_tokens)
        return body

    def _logprobs(self, logprobs: Sequence[common_pb2.TokenLogprob], tokenizer: PreTrainedTokenizerBase) -> dict:
        if self.kind == "chat":
            return {"content": [chat_logprob(lp, tokenizer) for lp in logprobs]}
        tokens = [tokenizer.decode([lp.token_id]) for lp in logprobs]
        offsets = []
        for token in tokens:
            offsets.append(self.text_offset)
            self.text_offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [
                {tokenizer.decode([t]): v for t, v in zip(lp.top_token_ids, lp.top_logprobs)} for lp in logprobs
            ],
            "text_offset": offsets,
        }


def chat_logprob(logprob: common_pb2.TokenLogprob, tokenizer: PreTrainedTokenizerBase) -> dict:
    """One token's entry of a chat completion's `logprobs.content`."""

    def entry(token_id: int, value: float) -> dict:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    return {
        **entry(logprob.token_id, logprob.logprob),
        "top_logprobs": [entry(t, v) for t, v in zip(logprob.top_token_ids, logprob.top_logprobs)],
    }
