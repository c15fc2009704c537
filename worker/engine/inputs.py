"""Checking images at `add_request`, before they reach the engine loop.

Image decoding and the vision preprocessing (resize, normalize, patchify) run here, in the
caller's thread, off the engine loop (TriInfer §4.1: the request processor prepares stage
inputs ahead of scheduling). Bytes are decoded by the shared, defensive
`triptych.processor.decode_image` (pixel limit checked from the header, before decoding).
"""

from __future__ import annotations

from typing import Any

from PIL import Image

from triptych import processor
from triptych.worker.engine.request import ImageTooLargeError, InvalidImageError


def decode_image(data: Any, max_pixels: int) -> Image.Image:
    """An RGB PIL image from bytes or a PIL image; typed errors for bad or too large ones."""
    if isinstance(data, processor.ImageInput):
        data = data.image
    if isinstance(data, bytes | bytearray | memoryview):
        try:
            data = processor.decode_image(bytes(data), max_pixels)
        except processor.ImageTooLargeError as exc:
            raise ImageTooLargeError(str(exc)) from None
        except processor.ImageError as exc:
            raise InvalidImageError(str(exc)) from None
    if not isinstance(data, Image.Image):
        raise InvalidImageError(f"an image must be bytes or a PIL image, got {type(data).__name__}")
    width, height = data.size
    if width * height > max_pixels:
        raise ImageTooLargeError(f"image is {width}x{height} = {width * height} pixels; the limit is {max_pixels}")
    return data.convert("RGB")
