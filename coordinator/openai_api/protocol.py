"""The request bodies of the OpenAI API that the front serves, as pydantic models: field names, types and the checks
that belong to the API's shape (ranges of the coordinator's own fields are the coordinator's to check).

Unknown fields are ignored, as OpenAI and vLLM do; fields whose behaviour the stack does not have (penalties, logit
bias, tools, n > 1, ...) are refused when set to anything but their no-op value (InvalidFieldError naming it), so
no request silently gets less than it asked for. `top_k`, `min_p`, `repetition_penalty`, `num_speculative_tokens`
and `draft_method` are extra body fields, as vLLM takes its extras (`extra_body=` in the openai client).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

from specdec.common.errors import InvalidFieldError
from specdec.sampling.token_logprobs import MAX_TOP_LOGPROBS

NO_OP_VALUES: dict[str, tuple] = {  # a field the stack cannot honour, and the values that ask nothing of it
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "parallel_tool_calls": (None, True, False),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: StrictStr = ""
    schema_: dict[str, Any] = Field(alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """`{"type": "text"}`, `{"type": "json_object"}` or `{"type": "json_schema", "json_schema": {"schema": ...}}`:
    the output is held to it by the coordinator's constraint (GenerateRequest.constraint)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise InvalidFieldError("response_format", "type json_schema needs json_schema.schema")
        return self


class CommonFields(BaseModel):
    """What chat and text completions share."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: StrictInt | None = Field(None, ge=0, lt=2**63)
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt = 1  # one choice per request (ask again for more)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    response_format: ResponseFormat | None = None
    # extra body fields, as vLLM takes them
    repetition_penalty: float | None = None
    min_p: float | None = None
    top_k: StrictInt | None = Field(None, ge=-1)  # -1 or 0: off
    num_speculative_tokens: StrictInt | None = Field(None, ge=0)
    draft_method: Literal["model", "ngram"] | None = None

    @model_validator(mode="after")
    def _honourable(self) -> CommonFields:
        for field, value in (self.model_extra or {}).items():
            if field in NO_OP_VALUES and value not in NO_OP_VALUES[field]:
                raise InvalidFieldError(field, "not supported by this server")
        if self.n != 1:
            raise InvalidFieldError("n", f"this server returns one choice per request; send it {self.n} times instead")
        if self.stream_options is not None and not self.stream:
            raise InvalidFieldError("stream_options", "only allowed when stream is true")
        return self

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: StrictStr
    content: StrictStr | list[dict[str, Any]] | None = None

    @property
    def text(self) -> str:
        """The content as text: a string, or the text parts of a list of content parts."""
        if isinstance(self.content, list):
            if any(part.get("type") != "text" for part in self.content):
                raise InvalidFieldError("messages", "only text content parts are supported")
            return "".join(str(part.get("text", "")) for part in self.content)
        return self.content or ""


class ChatCompletionRequest(CommonFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


class CompletionRequest(CommonFields):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # the alternatives per token

    @property
    def single_prompt(self) -> str | list[int]:
        """The one prompt of the request (a list of several is refused: one completion per request)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise InvalidFieldError("prompt", "one prompt per request")
            return prompt[0]
        return prompt
