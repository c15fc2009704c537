"""Typed errors for bad video input.

All derive from `triptych.processor.ProcessorError` (a `ValueError`), the class the router
already answers with a 400 and an OpenAI error body; the subclass says which check failed.
"""

from __future__ import annotations

from triptych.processor import ProcessorError


class VideoError(ProcessorError):
    """Bad video input (the router answers 400)."""


class InvalidVideoError(VideoError):
    """The bytes are not a readable video container with a video stream."""


class CorruptVideoError(InvalidVideoError):
    """The container opened but its frames do not decode (truncated or damaged bitstream)."""


class UnsupportedCodecError(VideoError):
    """The video stream's codec is not one we decode."""


class VideoTooLongError(VideoError):
    """More seconds or more frames than the limits allow."""


class VideoTooLargeError(VideoError):
    """More bytes or more pixels per frame than the limits allow."""


class EmptyVideoError(VideoError):
    """The video stream holds no frames."""
