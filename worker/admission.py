"""A stage run's image work, done off the event loop: the content-hash
check, the full image decode and the vision preprocessing (resize, normalise).

The router reads only image headers; the one full decode happens here, on the encode
instance. Done inline (as the engine's admission would do it inside `add_request`, on
the event loop) a few large images stall every other request and `/health` for
seconds. `DecodePool` runs it on a small thread pool (PIL, hashlib and the processor's
numpy/torch kernels release the GIL) with a bound on work queued: past it a stage run
gets 503 (retry elsewhere) instead of queueing without limit.

The worker re-hashes every image's bytes: the content hash is the MM cache key, so a
caller that sent other bytes under an image's hash would poison that image's cached
embedding for every later request (400).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from triptych.processor import MMItem
from triptych.stage_protocol import video_content_key
from triptych.worker.engine.inputs import decode_image
from triptych.worker.engine.request import RequestValidationError
from triptych.worker.errors import BadPayloadError, OverloadedError

T = TypeVar("T")


class DecodePool:
    """`workers` threads; at most `max_pending` jobs running or queued, then 503."""

    def __init__(self, workers: int = 2, max_pending: int = 16) -> None:
        if workers < 1 or max_pending < workers:
            raise ValueError(f"need workers >= 1 and max_pending >= workers, got {workers}, {max_pending}")
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="triptych-decode")
        self.max_pending = max_pending
        self.pending = 0  # only touched on the event loop's thread

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self.pending >= self.max_pending:
            raise OverloadedError(f"{self.pending} image jobs already queued on this instance; retry elsewhere")
        self.pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        finally:
            self.pending -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def decode_payload(images: Mapping[str, bytes], items: Sequence[Any] = ()) -> dict[str, bytes]:
    """The stage request's images (and videos), each checked against its content hash:
    sha256 of the bytes for an image (as the router computes it:
    triptych.processor.ImageInput), `video_content_key` for a video item."""
    videos = {it.content_hash: it.video for it in items if getattr(it, "kind", "image") == "video"}
    # A video taken as frames (LLaVA) is sent once under its key, with its frames' options.
    videos.update({it.frame.video: it.video for it in items if getattr(it, "frame", None) is not None})
    out: dict[str, bytes] = {}
    for h, raw in images.items():
        options = videos.get(h)
        actual = video_content_key(raw, options) if options is not None else hashlib.sha256(raw).hexdigest()
        if actual != h:
            raise BadPayloadError(f"image sent under content hash {h[:16]} hashes to {actual[:16]}; refused")
        out[h] = raw
    return out


def vision_inputs(vision: Any, max_pixels: int, items: Sequence[MMItem], images: Mapping[str, bytes]) -> dict[str, Any]:
    """Decode and preprocess every image given here; checks what the engine's admission
    would check (size limit, a visual-token count that fits the placeholder run), so the
    engine finds the inputs ready and does no image work on the event loop."""
    out: dict[str, Any] = {}
    for item in items:
        h = item.content_hash
        if h in out or h not in images or getattr(item, "kind", "image") == "video":
            continue  # videos are decoded by the collaborative decoder (stage_run._decode_videos)
        image = decode_image(images[h], max_pixels)  # typed 400s for bad or too large images
        vin = vision.preprocess(image)
        if vin.num_tokens != item.length:
            raise RequestValidationError(
                f"image {h[:16]} ({image.width}x{image.height}) gives {vin.num_tokens} visual tokens "
                f"but its placeholder run has {item.length}")
        out[h] = vin
    return out
