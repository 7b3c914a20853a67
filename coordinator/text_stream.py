"""Incremental detokenization with stop rules: turns committed tokens into text chunks and a finish reason."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from specdec.v1 import common_pb2

REPLACEMENT_CHAR = "\ufffd"
CONSTRAINT_DEAD_END = "constraint_dead_end"  # the finish reason of a request whose constraint allows no next token


@dataclass
class Chunk:
    """What one round adds to the completion."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "length", "stop", "eos", CONSTRAINT_DEAD_END on the last chunk
    logprobs: Sequence[common_pb2.TokenLogprob] = ()  # of token_ids, when the request asked for them


@dataclass
class TextStream:
    """Accumulates generated tokens; emits text that is final (never part of a pending stop string or
    an unfinished multi-byte character) and stops on EOS, a stop string or the token budget."""

    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: Collection[int]
    stop_strings: Sequence[str]
    max_new_tokens: int
    token_ids: list[int] = field(default_factory=list)
    emitted_chars: int = 0
    finish_reason: str | None = None

    def add(self, new_token_ids: Sequence[int], ended: str | None = None) -> Chunk:
        """Takes one round's committed tokens; tokens past a stop condition are dropped. `ended`: the reason the
        request ends after them, unless a stop condition among them came first."""
        accepted: list[int] = []
        for token in new_token_ids:
            if self.finish_reason:
                break
            accepted.append(token)
            if token in self.eos_token_ids:
                self.finish_reason = "eos"
            self.token_ids.append(token)
            if not self.finish_reason and self._stop_index(self._text()) is not None:
                self.finish_reason = "stop"
            if not self.finish_reason and len(self.token_ids) >= self.max_new_tokens:
                self.finish_reason = "length"
        self.finish_reason = self.finish_reason or ended
        return Chunk(self._take_text(), accepted, self.finish_reason)

    def _text(self) -> str:
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=True)

    def _stop_index(self, text: str) -> int | None:
        hits = [text.find(stop) for stop in self.stop_strings if stop and stop in text]
        return min(hits) if hits else None

    def _take_text(self) -> str:
        text = self._text()
        if self.finish_reason == "stop":
            final_len = self._stop_index(text)
        elif self.finish_reason:
            final_len = len(text)
        else:
            final_len = len(text.rstrip(REPLACEMENT_CHAR))  # an unfinished UTF-8 sequence may still complete
            for stop in self.stop_strings:  # hold back a tail that could grow into a stop string
                for k in range(min(len(stop) - 1, final_len), 0, -1):
                    if text[:final_len].endswith(stop[:k]):
                        final_len -= k
                        break
        chunk = text[self.emitted_chars : final_len] if final_len > self.emitted_chars else ""
        self.emitted_chars = max(self.emitted_chars, final_len)
        return chunk

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return self._text()[: self.emitted_chars]
