"""Checking a request at `add_request`, before it touches the engine loop.

Everything that can be wrong with one request (bad image bytes, too many pixels, a prompt
longer than the context, placeholders that do not match the image, a stage this role
does not run) raises a typed `InvalidRequestError` here, in the caller's thread; the
engine loop never sees the request and keeps serving the others. Image decoding and the
vision preprocessing (resize, normalize, patchify) also run here, off the engine loop
(TriInfer §4.1: the request processor prepares stage inputs ahead of scheduling).
"""

from __future__ import annotations

import io
from typing import Any

from PIL import Image

from triptych.worker.engine.request import EngineImageError


def decode_image(data: Any, max_pixels: int) -> Image.Image:
    """A PIL image (RGB) from bytes or a PIL image, checking the pixel limit before the
    pixels are decoded (a small file can declare a huge image)."""
    if isinstance(data, Image.Image):
        img = data
    elif isinstance(data, bytes | bytearray | memoryview):
        try:
            img = Image.open(io.BytesIO(bytes(data)))
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
            raise EngineImageError(f"image bytes are not a decodable image: {exc}") from exc
    else:
        raise EngineImageError(f"an image must be bytes or a PIL image, got {type(data).__name__}")
    width, height = img.size
    if width < 1 or height < 1:
        raise EngineImageError(f"image has no pixels ({width}x{height})")
    if width * height > max_pixels:
        raise EngineImageError(
            f"image of {width}x{height} = {width * height} pixels is over the limit of {max_pixels} pixels")
    try:
        return img.convert("RGB")  # forces the decode: truncated or corrupt data fails here
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise EngineImageError(f"image data is corrupt: {exc}") from exc
