"""The encode instance's side of the V -> E hand-over: pull a video's decoded GOP sets.

A video decoded on V instances reaches the encode instance as `VideoPart`s (one per GOP
set, in order), each a handle on a V's video buffer. Like an embedding (HydraInfer §4.3,
steps 2-4) the encoder reserves blocks of its own registered staging buffer, READs the
part over the transfer engine (NIXL, or the explicit TCP fallback), confirms the lease
(the V frees), copies the rows out and frees its staging blocks. Parts are whole temporal
patches (paper 000 Fig. 7b: every GOP set but the last holds a multiple of the temporal
patch size), so their rows concatenate to the whole video's patches bit for bit.

The staging buffer is allocated at the first such video (text and image instances never
pay for it) and registered on each transfer engine it is used with (a role switch may
build a new one).
"""

from __future__ import annotations

import threading

import numpy as np
from pydantic import ValidationError

from triptych.stage_protocol import VideoPart
from triptych.worker.migration import BadHandleError, NoFreeBlocksError, pull_errors
from triptych.worker.transfer import TransferEngine
from triptych.worker.transfer.base import BlockHandle
from triptych.worker.video_buffer import REGION, VideoBuffer, VideoBufferFullError


class VideoPuller:
    def __init__(self, max_bytes: int, bytes_pulled: dict[str, int] | None = None) -> None:
        self.max_bytes = max_bytes
        self.bytes_pulled = {} if bytes_pulled is None else bytes_pulled  # transport -> bytes
        self.buffer: VideoBuffer | None = None
        self._registered_on: set[str] = set()  # agent names of the engines holding the region
        self._lock = threading.Lock()

    def _staging(self, transfer: TransferEngine, patch_dim: int) -> VideoBuffer:
        with self._lock:
            if self.buffer is None:
                self.buffer = VideoBuffer(patch_dim, self.max_bytes)
            if self.buffer.patch_dim != patch_dim:
                raise BadHandleError(f"video parts of {patch_dim}-wide patches; this instance's are "
                                     f"{self.buffer.patch_dim}")
            if transfer.agent_name not in self._registered_on:
                transfer.register(REGION, self.buffer.tensor)
                self._registered_on.add(transfer.agent_name)
            return self.buffer

    def pull(self, transfer: TransferEngine, parts: list[VideoPart], patch_dim: int,
             timeout_s: float) -> tuple[np.ndarray, tuple[int, int, int]]:
        """Every part's rows, concatenated in segment order, and the video's grid. Blocking
        (run it in a thread). Typed failures: worker.migration's errors."""
        if not parts:
            raise BadHandleError("a video item without parts")
        ordered = sorted(parts, key=lambda p: p.index)
        sizes = {tuple(p.grid_thw[1:]) for p in ordered}
        if len(sizes) != 1:
            raise BadHandleError(f"video parts of different frame sizes: {sorted(sizes)}")
        buffer = self._staging(transfer, patch_dim)
        chunks = []
        for part in ordered:
            try:
                handle = BlockHandle.model_validate(part.handle)
            except ValidationError as exc:
                raise BadHandleError(f"malformed video part handle: {exc.errors()[0]['msg']}") from exc
            if part.rows != part.grid_thw[0] * part.grid_thw[1] * part.grid_thw[2] or \
                    buffer.blocks_for(part.rows) != len(handle.block_ids):
                raise BadHandleError(f"video part {part.index}: {part.rows} rows do not fit grid {part.grid_thw} "
                                     f"and {len(handle.block_ids)} blocks")
            try:
                ids = buffer.reserve(part.rows)
            except VideoBufferFullError as exc:
                raise NoFreeBlocksError(f"no staging room for video part {part.index}: {exc}") from exc
            try:
                with pull_errors(f"video part {part.index}"):
                    nbytes = transfer.pull(handle, REGION, ids, timeout_s=timeout_s)
                self.bytes_pulled[transfer.transport] = self.bytes_pulled.get(transfer.transport, 0) + nbytes
                chunks.append(buffer.read(ids, part.rows))
            finally:
                buffer.free(ids)
        t = sum(p.grid_thw[0] for p in ordered)
        return np.concatenate(chunks), (t, *ordered[0].grid_thw[1:])
