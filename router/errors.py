"""OpenAI's error JSON and the exception handlers that produce it.

Every failure a client sees has the body
`{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}`.
Validation problems are 400 (never FastAPI's 422); malformed JSON is 400 too.
"""

from __future__ import annotations

import logging
import math
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from triptych.router.backend import BackendError

log = logging.getLogger("triptych.router.errors")

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


class OpenAIError(Exception):
    """An error with an HTTP status and OpenAI's error fields."""

    def __init__(self, status_code: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.type = type or error_type(status_code)
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        # Retry-After takes whole seconds; round up so a client never retries too early.
        return {"Retry-After": str(max(0, math.ceil(self.retry_after)))}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers())


class InvalidRequestError(OpenAIError):
    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(400, message, param=param, code=code)


def error_type(status_code: int) -> str:
    return _TYPE_BY_STATUS.get(status_code, "server_error" if status_code >= 500 else "invalid_request_error")


def from_backend(exc: BackendError) -> OpenAIError:
    status = exc.status_code if 400 <= exc.status_code <= 599 else 500
    code = exc.code or {429: "rate_limit_exceeded", 503: "service_unavailable", 504: "timeout"}.get(status)
    return OpenAIError(status, exc.message, code=code, retry_after=exc.retry_after)


_UNION_TAGS = {"text", "image_url", "video_url"}  # content part discriminators (protocol.py)
_TYPE_SEGMENTS = {"str", "int", "float", "bool", "none", "dict", "list"}


def _is_type_segment(part: str) -> bool:
    """pydantic names union branches and validators in `loc` ('str', 'list[...]',
    'function-after[...]'); they are not fields and do not belong in `param`."""
    return part in _TYPE_SEGMENTS or "[" in part


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    """('body', 'messages', 0, 'content', 'list[...]', 1, 'image_url', 'image_url', 'url')
    -> 'messages[0].content[1].image_url.url'."""
    out = ""
    prev: Any = None
    for p in loc[1:] if loc[:1] == ("body",) else loc:
        if isinstance(p, int):
            out += f"[{p}]"
        elif _is_type_segment(str(p)) or (isinstance(prev, int) and p in _UNION_TAGS):
            pass  # a discriminated union's tag follows the list index of the part
        else:
            out += f".{p}" if out else str(p)
        prev = p
    return out or None


def _message(err: dict[str, Any]) -> str:
    if err.get("type") == "extra_forbidden":
        return "unrecognized request argument (not supported by this server)"
    return str(err.get("msg", "invalid value"))


def from_validation(exc: RequestValidationError) -> OpenAIError:
    errors = list(exc.errors())
    if not errors:
        return InvalidRequestError("invalid request")
    if any(e.get("type") == "json_invalid" for e in errors):
        err = next(e for e in errors if e.get("type") == "json_invalid")
        detail = err.get("ctx", {}).get("error") or err.get("msg")
        return InvalidRequestError(f"malformed JSON in the request body: {detail}", code="invalid_json")
    if len(errors) == 1 and tuple(errors[0].get("loc", ())) == ("body",) and (
            isinstance(errors[0].get("input"), (bytes, str)) or errors[0].get("type") == "missing"):
        # Not JSON, or no body at all (FastAPI reports the whole body as a missing field).
        return InvalidRequestError("the request body must be a JSON object (Content-Type: application/json)",
                                   code="invalid_json")
    # The deepest error is the most specific (a union reports one error per branch).
    depth = max(len(e.get("loc", ())) for e in errors)
    deepest = [e for e in errors if len(e.get("loc", ())) == depth]
    param = _loc_to_param(tuple(deepest[0].get("loc", ())))
    same = [e for e in deepest if _loc_to_param(tuple(e.get("loc", ()))) == param]
    msg = " or ".join(dict.fromkeys(_message(e) for e in same))
    return InvalidRequestError(f"{param}: {msg}" if param else msg, param=param)


async def _openai_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, OpenAIError)
    return exc.response()


async def _validation_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return from_validation(exc).response()


async def _backend_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, BackendError)
    return from_backend(exc).response()


async def _http_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    try:
        phrase = HTTPStatus(exc.status_code).phrase
    except ValueError:
        phrase = "error"
    message = exc.detail if isinstance(exc.detail, str) and exc.detail else phrase
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    err = OpenAIError(exc.status_code, message, code=code)
    response = err.response()
    for k, v in (exc.headers or {}).items():
        response.headers[k] = v
    return response


async def _unhandled_handler(_: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error", exc_info=exc)
    return OpenAIError(500, "internal server error", code="internal_error").response()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(OpenAIError, _openai_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(BackendError, _backend_handler)
    app.add_exception_handler(StarletteHTTPException, _http_handler)
    app.add_exception_handler(Exception, _unhandled_handler)
