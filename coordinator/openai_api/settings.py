"""Settings of the OpenAI-compatible HTTP front, inside the coordinator or in a process of its own."""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

from specdec.common.settings import setting


@dataclass(frozen=True)
class HttpApiSettings:
    """What the HTTP front serves, wherever it runs (a base of the coordinator's and the front's settings)."""

    served_model_name: str = setting(
        "", "the name requests give as `model` and /v1/models lists (empty: the tokenizer directory's name)"
    )
    default_max_tokens: int = setting(
        256, "tokens a chat completion that sets neither max_tokens nor max_completion_tokens may generate"
    )
    http_request_timeout_s: float = setting(
        600.0, "deadline of each HTTP request, from its arrival to its last token (then HTTP 504)"
    )

    def model_names(self, tokenizer: str) -> list[str]:
        """The names `model` may take: the served name (or the tokenizer directory's name) and the tokenizer's id."""
        name = self.served_model_name or pathlib.Path(tokenizer.rstrip("/")).name or tokenizer
        return [name, tokenizer] if name != tokenizer else [name]
