"""The front door of /v1/*: API keys, the body read under its size cap and deadline, a
deadline on every write to the client, the in-flight gauge and the final-status counter.
Pure ASGI, so nothing of a request is parsed before its caller is authorized."""

from __future__ import annotations

import asyncio
import hmac
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from triptych.router.errors import OpenAIError
from triptych.router.state import RouterState
from triptych.router.streaming import CLIENT_GONE, STATUS_KEY

log = logging.getLogger("triptych.router.front_door")

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")
GUARDED_PATHS = ("/tokenize", "/detokenize")  # outside /v1, but they take bodies and cost CPU


class ClientGone(Exception):
    """The client disconnected before the response was complete."""


class SendTimeout(Exception):
    """A write to the client did not complete in time (it stopped reading)."""


PUMP_KEY = "triptych.pump"  # scope key: the request's EventPump, closed when the client is dropped


class FrontDoor:
    """Pure ASGI middleware for /v1/*: checks the API key before the body is even read
    (so an unauthenticated client learns nothing about validation), reads the body under
    the size cap, turns an unexpected exception into a logged 500 in OpenAI's shape, and
    records every generation request's final status once its response has ended."""

    def __init__(self, app: ASGIApp, state: RouterState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not (scope["path"].startswith("/v1/") or scope["path"] in GUARDED_PATHS):
            await self.app(scope, receive, send)
            return
        counted = scope["method"] == "POST" and scope["path"] in GENERATION_PATHS
        metrics = self.state.metrics
        started: dict[str, int] = {}

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                started["status"] = message["status"]
            try:
                async with asyncio.timeout(self.state.config.send_timeout_s):
                    await send(message)
            except TimeoutError:
                raise SendTimeout() from None

        if counted:
            metrics.in_flight.labels(metrics.model).inc()
        try:
            self._authorize(scope)
            config = self.state.config
            replay = await _read_body(scope, receive, config.max_request_bytes, config.body_read_timeout_s)
            await self.app(scope, replay, send_wrapper)
        except OpenAIError as exc:
            await _send_error(exc, scope, receive, send_wrapper, started)
        except SendTimeout:
            # The client stopped reading: drop it and free everything the request holds.
            log.info("dropping %s: a write blocked for %.0fs", scope["path"], self.state.config.send_timeout_s)
            scope[STATUS_KEY] = CLIENT_GONE
            pump = scope.get(PUMP_KEY)
            if pump is not None:
                await pump.close()
        except ClientGone:
            scope[STATUS_KEY] = CLIENT_GONE
        except asyncio.CancelledError:
            scope.setdefault(STATUS_KEY, CLIENT_GONE)
            raise
        except Exception:
            log.exception("unhandled error serving %s", scope["path"])
            err = OpenAIError(500, "internal server error", code="internal_error")
            await _send_error(err, scope, receive, send_wrapper, started)
        finally:
            if counted:
                metrics.in_flight.labels(metrics.model).dec()
                metrics.request_done(scope.get(STATUS_KEY) or started.get("status", 500))

    def _authorize(self, scope: Scope) -> None:
        if not self.state.api_keys:
            return
        auth = next((v.decode("latin-1") for k, v in scope["headers"] if k.lower() == b"authorization"), "")
        scheme, _, token = auth.partition(" ")
        if not auth:
            raise OpenAIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        if scheme.lower() != "bearer" or not _key_matches(token.strip(), self.state.api_keys):
            raise OpenAIError(401, "invalid API key", code="invalid_api_key")


async def _send_error(err: OpenAIError, scope: Scope, receive: Receive, send: Send,
                      started: dict[str, int]) -> None:
    if "status" in started:  # too late for a status: the response is under way
        return
    await err.response()(scope, receive, send)


def _key_matches(token: str, keys: frozenset[str]) -> bool:
    # Compare against every key in constant time: timing must not reveal a key's prefix.
    found = False
    for key in keys:
        found |= hmac.compare_digest(token.encode(), key.encode())
    return found


async def _read_body(scope: Scope, receive: Receive, limit: int, timeout_s: float) -> Receive:
    """Read the whole body under `limit` (413 past it, Content-Length or not) within
    `timeout_s` (408 after it: a client trickling bytes must not hold a slot forever), then
    hand the app a receive that replays it and afterwards reports the client's disconnect."""
    too_large = OpenAIError(413, f"request body is larger than the {limit} byte limit", code="request_too_large")
    declared = next((v for k, v in scope["headers"] if k.lower() == b"content-length"), b"")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks: list[bytes] = []
    total = 0
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone()
                total += len(message.get("body", b""))
                if total > limit:
                    raise too_large
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    break
    except TimeoutError:
        raise OpenAIError(408, f"the request body did not arrive within {timeout_s:g}s",
                          code="request_timeout") from None
    pending: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay
