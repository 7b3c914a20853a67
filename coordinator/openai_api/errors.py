"""Errors in OpenAI's shape: a status of the request path (the gRPC code the Coordinator would answer) becomes the
matching HTTP status and `{"error": {"message", "type", "param", "code"}}`, naming the field in the API's own words.

Domain errors become gRPC codes in one place (specdec/serving/grpc_errors.py); this module only maps those codes
on to HTTP, so both APIs fail a request the same way.
"""

from __future__ import annotations

from collections.abc import Mapping

import grpc
import pydantic
from starlette.responses import JSONResponse

from specdec.common.errors import InvalidFieldError

# gRPC code -> (HTTP status, OpenAI error type, OpenAI error code)
HTTP_STATUS: dict[grpc.StatusCode, tuple[int, str, str | None]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", None),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", None),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    grpc.StatusCode.ABORTED: (409, "conflict_error", None),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error", None),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error", None),
}
SERVER_ERROR = (500, "server_error", None)
# The Coordinator's field names that the OpenAI API spells otherwise (either endpoint).
OPENAI_PARAMS = {
    "max_new_tokens": "max_tokens",
    "sampling.temperature": "temperature",
    "sampling.top_p": "top_p",
    "sampling.top_k": "top_k",
    "sampling.seed": "seed",
    "text": "prompt",
    "token_ids.ids": "prompt",
    "constraint.json_schema": "response_format",
    "constraint.json_object": "response_format",
}


class FrontError(Exception):
    """A request that failed with a status of the request path; `param` names the OpenAI field at fault."""

    def __init__(self, code: grpc.StatusCode, message: str, param: str | None = None):
        super().__init__(message)
        self.code = code
        self.param = param

    @classmethod
    def invalid(cls, field: str, problem: str) -> FrontError:
        return cls(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {problem}", field)

    @classmethod
    def of_validation(cls, error: pydantic.ValidationError) -> FrontError:
        """The first problem pydantic found, naming its field (`messages.0.role`) or the one a check raised for."""
        first = error.errors(include_url=False)[0]
        raised = (first.get("ctx") or {}).get("error")
        if isinstance(raised, InvalidFieldError):
            return cls.invalid(raised.field, str(raised).removeprefix(f"{raised.field}: "))
        field = ".".join(str(part) for part in first["loc"]) or "body"
        return cls.invalid(field, first["msg"])

    @classmethod
    def of_status(cls, code: grpc.StatusCode, message: str, renamed: Mapping[str, str] = {}) -> FrontError:
        """A Coordinator status; an INVALID_ARGUMENT message starts with the field it names (`max_new_tokens: ...`),
        reported under its OpenAI name (`renamed` first, for what an endpoint spells its own way)."""
        param = None
        if code == grpc.StatusCode.INVALID_ARGUMENT and ": " in message:
            field = message.split(": ", 1)[0]
            param = renamed.get(field) or OPENAI_PARAMS.get(field) or field.removeprefix("sampling.")
            message = f"{param}: {message.split(': ', 1)[1]}"
        return cls(code, message, param)

    def named(self, renamed: Mapping[str, str]) -> FrontError:
        """This error with the field its message starts with under its OpenAI name (see of_status)."""
        return self if self.param is not None else FrontError.of_status(self.code, str(self), renamed)

    def response(self) -> JSONResponse:
        status, kind, code = HTTP_STATUS.get(self.code, SERVER_ERROR)
        body = {"message": str(self), "type": kind, "param": self.param, "code": code}
        return JSONResponse({"error": body}, status_code=status)

    def event(self) -> dict:
        """The error as the body of a server-sent event (a stream that fails after it began)."""
        status, kind, code = HTTP_STATUS.get(self.code, SERVER_ERROR)
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": code or status}}
