"""Errors as JSON bodies: OpenAI's shape on /v1 routes, LoRAX's on /, /generate and /generate_stream.

OpenAI: {"error": {"message", "type", "param", "code"}}. LoRAX: {"error": message, "error_type"}.
The engine's typed errors (loraplane_server.errors) get their status codes here alone: `api_error`;
`install_handlers` answers ApiError, Rejected (admission), pydantic's and Starlette's errors in these shapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from loraplane_server.errors import (
    AdapterError,
    AdapterInUseError,
    EmptyPromptError,
    EngineError,
    EngineShutdownError,
    InvalidParameterError,
    InvalidPromptError,
    InvalidRequestError,
    InvalidTokenIdError,
    PinLimitError,
    PromptTooLongError,
    UnknownAdapterError,
)

LORAX_PATHS = frozenset({"/", "/generate", "/generate_stream"})
_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}
UNICODE_ERROR = "string_unicode"  # pydantic's own error type for bad Unicode, raised by ValidText (sampling.py)
UNKNOWN_FIELD = "extra_forbidden"  # pydantic's error type for a field a body model does not know (extra="forbid")


class ApiError(Exception):
    """A request's own error: its status code and a message the caller can act on."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


class Rejected(Exception):
    """A request refused at the door (Lifecycle.admit): status 429 (queue full) or 503 (loading, draining, failed)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


def error_body(path: str, status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    if path in LORAX_PATHS:
        kind = "overloaded" if status in (429, 503) else "generation" if status >= 500 else "validation"
        return {"error": message, "error_type": kind}
    kind = _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(path: str, exc: ApiError) -> JSONResponse:
    body = error_body(path, exc.status, exc.message, exc.param, exc.code)
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


def rejected_error(exc: Rejected) -> ApiError:
    return ApiError(exc.status, str(exc), code=exc.reason, headers={"Retry-After": "1"})


class _Status(NamedTuple):
    status: int
    code: str
    message: str | None = None  # None: the error's own
    retry: bool = False  # Retry-After: 1


# an engine error's status: the row of the nearest class in its MRO
_ENGINE_STATUS: dict[type[EngineError], _Status] = {
    UnknownAdapterError: _Status(404, "adapter_not_found"),
    AdapterError: _Status(400, "invalid_adapter"),
    AdapterInUseError: _Status(409, "adapter_in_use"),
    PinLimitError: _Status(409, "pin_limit"),
    InvalidParameterError: _Status(422, "invalid_parameter"),
    EmptyPromptError: _Status(400, "empty_prompt"),
    PromptTooLongError: _Status(400, "context_length_exceeded"),
    InvalidTokenIdError: _Status(400, "invalid_token_id"),
    InvalidPromptError: _Status(400, "invalid_prompt"),
    InvalidRequestError: _Status(400, "invalid_request"),
    EngineShutdownError: _Status(503, "shutting_down", "the server is shutting down", retry=True),
    EngineError: _Status(500, "engine_error"),
}


def api_error(exc: EngineError, param: str | None = None, prefix: str | None = None) -> ApiError:
    """An engine error as the request's ApiError. `param`: the API's name for the offending field (an
    InvalidRequestError's message then names it so too); `prefix`: what the caller was doing."""
    row = next(_ENGINE_STATUS[c] for c in type(exc).__mro__ if c in _ENGINE_STATUS)
    if param is not None and isinstance(exc, InvalidRequestError):
        message = exc.naming(param)
    else:
        message = row.message or str(exc)
    if prefix is not None:
        message = f"{prefix}: {message}"
    headers = {"Retry-After": "1"} if row.retry else None
    return ApiError(row.status, message, param=param or exc.param, code=row.code, headers=headers)


def describe_validation(errors: Sequence[Any]) -> tuple[str, str | None]:
    """Pydantic errors -> (message naming the fields, the first field's dotted name)."""
    parts, first = [], None
    for err in list(errors)[:4]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        name = (".".join(loc) + (err.get("ctx") or {}).get("path", "")) or "body"
        first = first or name
        parts.append(f"{name}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request", first


def _is_branch(part: object) -> bool:
    """A union's branch in a pydantic location (content.list[TextPart].0.x): a name the client never wrote."""
    return isinstance(part, str) and "[" in part


def describe_unknown(errors: Sequence[Any]) -> tuple[str, str]:
    """Unknown-field errors -> (message naming every such field, the first one's dotted name)."""
    names = [".".join(str(x) for x in err.get("loc", ()) if x != "body" and not _is_branch(x)) for err in errors]
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    message = (
        f"unknown field{'s' if len(names) > 1 else ''} {shown}: this server does not support "
        f"{'them' if len(names) > 1 else 'it'}, and refuses rather than ignores what it cannot honour "
        "(its fields: GET /openapi.json)"
    )
    return message, names[0]


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(request.url.path, exc)

    @app.exception_handler(Rejected)
    async def _rejected(request: Request, exc: Rejected) -> JSONResponse:
        return error_response(request.url.path, rejected_error(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return error_response(request.url.path, ApiError(400, "the request body is not valid JSON"))
        # bad Unicode is malformed text, not an out-of-range value: 400, as for malformed JSON
        unicode = [e for e in errors if e.get("type") == UNICODE_ERROR]
        if unicode:
            message, param = describe_validation(unicode)
            return error_response(request.url.path, ApiError(400, message, param, code="invalid_unicode"))
        # a field the server does not know would otherwise be dropped without a word: 400, naming it
        unknown = [e for e in errors if e.get("type") == UNKNOWN_FIELD]
        if unknown:
            message, param = describe_unknown(unknown)
            return error_response(request.url.path, ApiError(400, message, param, code="unknown_field"))
        message, param = describe_validation(errors)
        return error_response(request.url.path, ApiError(422, message, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(exc.headers) if exc.headers else None
        return error_response(request.url.path, ApiError(exc.status_code, str(exc.detail), headers=headers))
