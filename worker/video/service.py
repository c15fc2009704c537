"""A video decoder service: the V instance's work, without model weights.

FlashCodec §3.2-3.3 (paper 000) spreads one video's GOP sets over several decoders; this
service is one such decoder reachable over HTTP, so a `CollaborativeDecoder` on the
encode instance can mix local slots with remote ones (`worker/video/remote.py`). The video
bytes are uploaded once per instance (`PUT /internal/video/{video_id}`, checked against
the content hash) and each GOP set is then a small JSON `Segment`
(`POST /internal/video/{video_id}/segment`) answered with the segment's RGB frames as raw
uint8 (`X-Frame-Shape: n,h,w,3`). Held videos are evicted least recently used, by bytes.

This is the static decoder service an encode instance drives itself
(`TRIPTYCH_VIDEO_DECODERS`); the V instance type of the topology, driven by the router and
handing patches over by NIXL pull, is worker/video_instance.py (it reuses `VideoStore`).
"""

from __future__ import annotations

import argparse
import asyncio
import threading
from collections import OrderedDict
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from .collaborative import video_id
from .decode import PyAVBackend
from .errors import VideoError
from .segments import Segment

SHAPE_HEADER = "X-Frame-Shape"
DEFAULT_CACHE_BYTES = 512 * 1024 * 1024


class VideoStore:
    """Uploaded videos by content hash, least recently used evicted past `max_bytes`."""

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES, on_evict: Callable[[str], None] | None = None) -> None:
        self.max_bytes = max_bytes
        self.on_evict = on_evict  # e.g. the NVDEC backend's temporary file of the video goes
        self._videos: OrderedDict[str, bytes] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def put(self, vid: str, data: bytes) -> None:
        with self._lock:
            if vid in self._videos:
                self._videos.move_to_end(vid)
                return
            self._videos[vid] = data
            self._size += len(data)
            evicted = []
            while self._size > self.max_bytes and len(self._videos) > 1:
                old_id, old = self._videos.popitem(last=False)
                self._size -= len(old)
                evicted.append(old_id)
        for old_id in evicted:
            if self.on_evict is not None:
                self.on_evict(old_id)

    def get(self, vid: str) -> bytes | None:
        with self._lock:
            data = self._videos.get(vid)
            if data is not None:
                self._videos.move_to_end(vid)
            return data


def create_decoder_app(max_video_bytes: int = 256 * 1024 * 1024,
                       cache_bytes: int = DEFAULT_CACHE_BYTES) -> FastAPI:
    app = FastAPI(title="triptych video decoder")
    store = VideoStore(cache_bytes)
    backend = PyAVBackend()

    @app.put("/internal/video/{vid}")
    async def upload(vid: str, request: Request) -> Response:
        data = await request.body()
        if len(data) > max_video_bytes:
            return _error(413, f"video is larger than {max_video_bytes} bytes")
        if await asyncio.to_thread(video_id, data) != vid:
            return _error(400, "the bytes do not hash to the video id in the URL")
        store.put(vid, data)
        return Response(status_code=204)

    @app.post("/internal/video/{vid}/segment")
    async def segment(vid: str, body: Segment) -> Response:
        data = store.get(vid)
        if data is None or body.video_id != vid:
            return _error(404, f"video {vid[:16]} is not held here; upload it first")
        try:  # PyAV releases the GIL: decoding in a thread keeps the loop serving
            decoded = await asyncio.to_thread(backend.decode, data, body)
        except VideoError as exc:
            return _error(400, str(exc), type(exc).__name__)
        frames = decoded.frames
        return Response(frames.tobytes(), media_type="application/octet-stream",
                        headers={SHAPE_HEADER: ",".join(map(str, frames.shape))})

    @app.get("/live")
    async def live() -> dict[str, str]:
        return {"status": "ok"}

    return app


def _error(status: int, message: str, kind: str = "") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description="video decoder service (V instance, no model weights)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8300)
    args = parser.parse_args(argv)
    uvicorn.run(create_decoder_app(), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
