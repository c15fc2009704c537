"""The worker's failures as types, and the one table that maps them to HTTP statuses
(a stage run's response, or the `status` of an `ErrorEvent` mid-stream).

4xx: the request itself is wrong (the router passes it to the client, no retry); 5xx:
this instance could not serve it (the router may retry elsewhere). Nothing here or in
its callers reads an error's message to choose a status.
"""

from __future__ import annotations

from triptych.worker.engine.request import (
    HANDED_BACK,
    ImageTooLargeError,
    InvalidImageError,
    RequestOutput,
    RequestValidationError,
    StageNotServedError,
)
from triptych.worker.engine.video_inputs import InvalidVideoInputError
from triptych.worker.migration.errors import (
    BadHandleError,
    HandoffExpiredError,
    NoFreeBlocksError,
    PullFailedError,
)


class NotServingError(Exception):
    """This instance does not take the request now (unassigned, loading, draining, or its
    role does not run a stage asked of it)."""


class BadPayloadError(ValueError):
    """A field of the stage request cannot be decoded (e.g. an image that is not base64),
    or does not match what it claims (image bytes that do not hash to their content hash)."""


class OverloadedError(Exception):
    """This instance's bounded image-decode queue is full: retry elsewhere or later."""


# First match wins: subclasses before their bases.
_STATUS: tuple[tuple[type[BaseException], int], ...] = (
    # The role changed under the request (a switch between the run's admission and the
    # engine's): this instance, not the request, is wrong — the router tries another.
    (StageNotServedError, 503),
    (RequestValidationError, 400),
    (BadPayloadError, 400),
    (BadHandleError, 400),
    (NoFreeBlocksError, 503),
    (HandoffExpiredError, 503),
    (NotServingError, 503),
    (OverloadedError, 503),
    (PullFailedError, 502),
    (TimeoutError, 504),
)


def http_status(exc: BaseException) -> int:
    """The status for a failure; 500 for anything unforeseen."""
    for cls, status in _STATUS:
        if isinstance(exc, cls):
            return status
    return 500


# Client-facing error codes (OpenAI's `code`) for the input failures only the instance that
# decodes can find (the router reads image headers only): passed through to the client.
_CODE: tuple[tuple[type[BaseException], str], ...] = (
    (ImageTooLargeError, "image_too_large"),
    (InvalidImageError, "invalid_image"),
    (InvalidVideoInputError, "invalid_video"),  # a video whose frames only the decoder finds bad
)


def error_code(exc: BaseException) -> str | None:
    return next((code for cls, code in _CODE if isinstance(exc, cls)), None)


# The engine's message for the request it fails to break a KV-cache deadlock
# (engine.Engine._break_kv_deadlock). RequestOutput carries failures as text only; until
# it carries a kind, this exact message is the one capacity failure (503: retry
# elsewhere); anything else that fails after admission is ours (500).
_KV_EXHAUSTED = "KV cache exhausted"


def engine_failure_status(out: RequestOutput) -> int:
    """The status of a request the engine failed after admission (`out.error` is set)."""
    return 503 if out.error in (_KV_EXHAUSTED, HANDED_BACK) else 500
