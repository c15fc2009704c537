"""A decoder slot on a remote video decoder service (worker/video/service.py).

`CollaborativeDecoder(slots=[RemoteSlot(url), ..., LocalSlot()])` decodes one video's GOP
sets on several instances at once (FlashCodec §3.3: stall-free, a free slot takes the
next set). The video is uploaded to each service once (the first segment it gets); a
service that evicted it answers 404 and gets it again. A remote failure is typed: a bad
video is the service's 400 -> `CorruptVideoError`; an unreachable or failing service is
`RemoteDecoderError` (not the client's fault).
"""

from __future__ import annotations

import threading

import httpx
import numpy as np

from .decode import DecodedSegment
from .errors import CorruptVideoError
from .segments import Segment
from .service import SHAPE_HEADER


class RemoteDecoderError(RuntimeError):
    """The decoder service could not be reached or failed (a 5xx for the request)."""


class RemoteSlot:
    """One remote decoder; thread-safe (the collaborative decoder runs it on one thread)."""

    def __init__(self, url: str, timeout_s: float = 60.0, client: httpx.Client | None = None) -> None:
        self.url = url.rstrip("/")
        self._client = client or httpx.Client(timeout=timeout_s, trust_env=False)
        self._uploaded: set[str] = set()
        self._lock = threading.Lock()
        self.uploads = 0  # bytes-carrying requests made (tests and metrics)

    def run(self, data: bytes, segment: Segment) -> DecodedSegment:
        vid = segment.video_id
        if vid not in self._uploaded:
            self._upload(vid, data)
        resp = self._post(segment)
        if resp.status_code == 404:  # evicted there: send it again, once
            self._upload(vid, data)
            resp = self._post(segment)
        if resp.status_code == 400:
            raise CorruptVideoError(_message(resp))
        if resp.status_code != 200:
            raise RemoteDecoderError(f"decoder {self.url} answered {resp.status_code}: {_message(resp)}")
        shape = tuple(int(x) for x in resp.headers[SHAPE_HEADER].split(","))
        frames = np.frombuffer(resp.content, np.uint8).reshape(shape)
        return DecodedSegment(segment.index, segment.frame_indices, frames)

    def close(self) -> None:
        self._client.close()

    def _upload(self, vid: str, data: bytes) -> None:
        try:
            resp = self._client.put(f"{self.url}/internal/video/{vid}", content=data)
        except httpx.HTTPError as exc:
            raise RemoteDecoderError(f"decoder {self.url} unreachable: {type(exc).__name__}") from exc
        if resp.status_code != 204:
            raise RemoteDecoderError(f"decoder {self.url} refused the upload ({resp.status_code}): {_message(resp)}")
        with self._lock:
            self._uploaded.add(vid)
            self.uploads += 1

    def _post(self, segment: Segment) -> httpx.Response:
        try:
            return self._client.post(f"{self.url}/internal/video/{segment.video_id}/segment",
                                     content=segment.model_dump_json(),
                                     headers={"Content-Type": "application/json"})
        except httpx.HTTPError as exc:
            raise RemoteDecoderError(f"decoder {self.url} unreachable: {type(exc).__name__}") from exc


def _message(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp.text[:200]
