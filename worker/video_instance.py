"""The V instance: `triptych worker --role V` — video decoding as its own instance type.

FlashCodec (paper 000 §3) decodes one video collaboratively over several decoders: the
router splits a video's sampled frames into GOP-aligned segments whose frame counts are
multiples of the temporal patch size (Alg. 1, Fig. 7b) and hands them out stall-free over
the plan's V instances (Alg. 2, router/video_decode.py). This instance runs one such
decoder pool: it holds uploaded videos by content hash, decodes a segment on one of its
decoder threads (PyAV releases the GIL; NVDEC where CUDA and PyNvVideoCodec are there,
`--video-decoder`), patchifies the frames with the checkpoint's
video processor settings (`triptych.video_processing`: only the processor config is read,
no model weights and no engine), writes the patches into its registered video buffer
(worker/video_buffer.py) and offers the blocks under a lease. The encode instance pulls
them over the transfer engine (NIXL; HydraInfer §4.3 pull-based migration) and confirms;
the blocks are then freed (or at the lease's expiry, or when the router aborts).

Endpoints: `PUT /internal/video/{video_id}` (bytes; hash checked), `POST
/internal/video/segment` (a `VideoSegmentRequest` -> a `VideoPart`), `POST
/internal/abort/{request_id}`; `/live`, `/ready`, `/health`, `/metrics`, `/admin/stats`.
A V instance does not switch roles (`/admin/role` to anything but V is a 409).

Shut down (SIGTERM: a scale-down, a pod deleted) it drains (worker/draining.py): /health
says `draining` (the router deals it no more GOP sets), new uploads and segments get a
503 `draining` (the router's dispatcher hands them to the other V instances), the
segments it is decoding finish, and it stays up until the encode instance has pulled and
confirmed every part it offered (or their leases expired), bounded by the drain deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest

from triptych.processor import ProcessorError
from triptych.stage_protocol import VIDEO_DRAINING as DRAINING
from triptych.stage_protocol import RoleSwitch, VideoPart, VideoSegmentRequest
from triptych.topology import UNASSIGNED
from triptych.video_processing import VideoProcessorConfig, preprocess_frames
from triptych.worker.auth import AuthMiddleware, MissingTokenError, WorkerAuth
from triptych.worker.draining import DrainingServer
from triptych.worker.migration import LeaseTable, run_lease_pump
from triptych.worker.settings import WorkerSettings, settings_from_args
from triptych.worker.transfer import TransferEngine
from triptych.worker.transfer.base import registry_metric
from triptych.worker.video import Segment, VideoError, choose_backend, video_id
from triptych.worker.video.service import VideoStore
from triptych.worker.video_buffer import REGION, VideoBuffer, VideoBufferFullError

log = logging.getLogger("triptych.worker.video_instance")

SEGMENTS_DECODED: Counter = registry_metric(
    Counter, "triptych_worker_video_segments_total", "GOP sets decoded on this V instance, by outcome", ["outcome"])
SEGMENT_SECONDS: Histogram = registry_metric(
    Histogram, "triptych_worker_video_segment_seconds", "Decode + patchify time of one GOP set on a V instance",
    [], buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))


# Test hook: every GOP set takes at least this long on this instance, so a drain test can
# catch a V instance mid-decode (tests/serving/test_video_v_drain.py). Unset in production.
SEGMENT_DELAY_ENV = "TRIPTYCH_TEST_VIDEO_SEGMENT_DELAY_S"

# Model code a V instance never imports (it holds no weights): the model families, the
# engine's model runner and the transformers modeling code.
MODEL_MODULES = ("triptych.worker.models", "triptych.worker.engine.model_runner", "transformers.models")


class VideoDecoderInstance:
    """State of one V instance: videos, decoder threads, the video buffer and its leases."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        # What a V instance loads of the checkpoint: the video processor settings, nothing else.
        self.config = VideoProcessorConfig.from_pretrained(settings.model)
        c = self.config
        patch_dim = 3 * c.temporal_patch_size * c.patch_size * c.patch_size
        self.buffer = VideoBuffer(patch_dim, settings.video_buffer_mb << 20)
        self.store = VideoStore(settings.video_cache_mb << 20, on_evict=self._forget)
        self.backend, self.decoder_reason = choose_backend(settings.video_decoder, _gpu_id(settings.device))
        log.info("video decoder: %s", self.decoder_reason)
        self.transfer = TransferEngine(f"{settings.instance_id}-V", require=settings.transfer_require)
        self.transfer.register(REGION, self.buffer.tensor)
        self.leases = LeaseTable(on_any_release=lambda lease: self.transfer.revoke(lease.lease_id))
        self.slots = asyncio.Semaphore(max(1, settings.decode_threads))
        self.decoding = 0
        self.accepted = 0  # segment calls taken and not yet answered (waiting for a slot too)
        self.draining = False
        self.test_delay_s = float(os.environ.get(SEGMENT_DELAY_ENV, "0") or 0)
        self.counts = {"uploads": 0, "segments": 0, "refused": 0, "frames": 0}
        # Parked: a standby the planner can scale V onto (operator/planner/local_connector.py).
        # /health says `unassigned`, so the router picks it for no new video; it still
        # decodes what it is sent (GOP sets of a video already planned over it: zero loss).
        self.parked = False

    def load(self) -> float:
        return float(self.decoding)

    def begin_drain(self) -> bool:
        """A shutdown signal: take no more segments (worker/draining.py)."""
        self.draining = True
        return True

    async def drain(self) -> None:
        """Finish the segments taken, then wait for their parts to be pulled (each lease
        confirmed, or expired); past the drain deadline what is left is freed."""
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while (self.accepted or self.leases.outstanding()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.accepted or self.leases.outstanding():
            log.warning("drain deadline passed with %d segments and %d leases outstanding (freed at exit)",
                        self.accepted, self.leases.outstanding())
        else:
            log.info("drained: %d segments decoded, no parts left to pull", self.counts["segments"])

    def stats(self) -> dict[str, Any]:
        return {"role": "V", "instance_id": self.settings.instance_id, "transport": self.transfer.transport,
                # A V instance holds no model: no weights, no engine, no KV or MM cache.
                "weights_loaded": False, "loaded": ["video_processor_config"],
                # Checked by tests: no model code was ever imported into this process.
                "model_modules": sorted(m for m in sys.modules if m.startswith(MODEL_MODULES)),
                "inflight": self.decoding, "accepted": self.accepted, "draining": self.draining,
                "leases_outstanding": self.leases.outstanding(),
                "video_buffer_blocks": self.buffer.num_blocks, "video_buffer_free": self.buffer.free_blocks,
                "decoder_threads": self.settings.decode_threads, "decoder": self.backend.name,
                "decoder_reason": self.decoder_reason, **self.counts}

    async def decode(self, body: VideoSegmentRequest) -> VideoPart:
        """Decode one GOP set, patchify it, put the rows under a lease (Alg. 1 on this decoder)."""
        data = self.store.get(body.video_id)
        if data is None:
            raise LookupError(f"video {body.video_id[:16]} is not held here; upload it first")
        segment = Segment.model_validate(body.segment)
        if segment.video_id != body.video_id:
            raise ValueError("the segment names another video")
        config = self.config.with_pixel_bounds(body.options.min_pixels, body.options.max_pixels)
        async with self.slots:
            self.decoding += 1
            started = time.monotonic()
            try:  # frames are allocated after decoding (§3.4), patches once frames are done
                if self.test_delay_s:
                    await asyncio.sleep(self.test_delay_s)
                patches = await asyncio.to_thread(self._decode_patchify, data, segment, config)
            finally:
                self.decoding -= 1
        SEGMENT_SECONDS.observe(time.monotonic() - started)
        rows = patches.pixel_values_videos
        block_ids = self.buffer.reserve(len(rows))
        self.buffer.write(block_ids, rows)
        lease = self.leases.offer(REGION, block_ids, lambda: self.buffer.free(block_ids),
                                  self.settings.lease_seconds, owner=body.request_id)
        margin = min(self.settings.lease_margin_s, self.settings.lease_seconds / 4)
        handle = self.transfer.handle(REGION, block_ids, lease.lease_id, secret=lease.secret,
                                      ttl_s=lease.ttl_s, margin_s=margin)
        self.counts["segments"] += 1
        self.counts["frames"] += len(segment.frame_indices)
        return VideoPart(index=segment.index, num_frames=len(segment.frame_indices), rows=len(rows),
                         grid_thw=patches.grid_thw, handle=handle.model_dump(mode="json"))

    def _decode_patchify(self, data: bytes, segment: Segment, config: VideoProcessorConfig) -> Any:
        decoded = self.backend.decode(data, segment)
        frames = decoded.frames
        if not isinstance(frames, np.ndarray):  # NVDEC: RGB frames on the GPU; patchified on the CPU
            frames = frames.cpu().numpy()
        return preprocess_frames(frames, config)

    def _forget(self, vid: str) -> None:
        """A video left the store: the NVDEC backend's temporary file of it goes too."""
        release = getattr(self.backend, "release", None)
        if release is not None:
            release(vid)

    def close(self) -> None:
        self.leases.expire(now=float("inf"))
        self.transfer.close()
        close_backend = getattr(self.backend, "close", None)  # NVDEC: its temporary files
        if close_backend is not None:
            close_backend()


def _gpu_id(device: str) -> int:
    """The GPU of `--device cuda:N` (NVDEC runs there); 0 otherwise."""
    _, _, index = device.partition(":")
    return int(index) if device.startswith("cuda") and index.isdigit() else 0


def _error(status: int, message: str, code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": code or status}}, status_code=status)


def _draining() -> JSONResponse:
    # The router's dispatcher reads the code: the GOP set goes to another V instance.
    return _error(503, "this V instance is draining (shutting down); it takes no new segments", DRAINING)


def create_video_app(settings: WorkerSettings, auth: WorkerAuth) -> FastAPI:
    """The V instance's app; `auth` guards /internal and /admin as on every worker."""
    holder: dict[str, VideoDecoderInstance] = {}

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        inst = VideoDecoderInstance(settings)
        holder["v"] = inst
        app.state.instance = inst
        pump = asyncio.create_task(run_lease_pump(inst.transfer, inst.leases))
        yield
        pump.cancel()
        inst.close()

    app = FastAPI(title="triptych video decoder (V)", lifespan=lifespan)
    app.add_middleware(AuthMiddleware, auth=auth)

    @app.get("/live")
    async def live() -> dict[str, bool]:
        return {"live": True}

    @app.get("/health")
    async def health() -> JSONResponse:
        inst = holder["v"]
        body = {"status": "draining" if inst.draining else "ok", "role": UNASSIGNED if inst.parked else "V",
                "video": True, "instance_id": settings.instance_id, "load": inst.load(),
                "draining": inst.draining, "transport": inst.transfer.transport, "target_role": None}
        return JSONResponse(body, status_code=503 if inst.draining else 200)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        draining = holder["v"].draining
        return JSONResponse({"ready": not draining, "role": "V"}, status_code=503 if draining else 200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/admin/stats")
    async def admin_stats() -> dict[str, Any]:
        return holder["v"].stats()

    @app.post("/admin/role")
    async def admin_role(body: RoleSwitch) -> JSONResponse:
        # The operator "assigns" V to a V pod like any role (then labels the pod); it is one already.
        if body.role in ("V", UNASSIGNED):  # unassigned parks it (a standby V), V brings it back
            holder["v"].parked = body.role == UNASSIGNED
            return JSONResponse({"role": body.role, "status": "ok"})
        return _error(409, "a V instance decodes video only; it does not switch roles", "role_fixed")

    @app.put("/internal/video/{vid}")
    async def upload(vid: str, request: Request) -> Response:
        inst = holder["v"]
        if inst.draining:
            return _draining()
        data = await request.body()
        if len(data) > settings.video_cache_mb << 20:
            return _error(413, "video is larger than this instance's video store")
        if await asyncio.to_thread(video_id, data) != vid:
            return _error(400, "the bytes do not hash to the video id in the URL")
        inst.store.put(vid, data)
        inst.counts["uploads"] += 1
        return Response(status_code=204)

    @app.post("/internal/video/segment")
    async def segment(body: VideoSegmentRequest) -> JSONResponse:
        inst = holder["v"]
        if inst.draining:
            return _draining()
        inst.accepted += 1
        try:
            part = await inst.decode(body)
        except LookupError as exc:
            return _error(404, str(exc), "video_not_held")
        except (VideoError, ProcessorError, ValueError) as exc:  # a bad video: the client's fault
            inst.counts["refused"] += 1
            SEGMENTS_DECODED.labels("invalid").inc()
            return _error(400, str(exc), "invalid_video")
        except VideoBufferFullError as exc:
            SEGMENTS_DECODED.labels("full").inc()
            return _error(503, str(exc), "video_buffer_full")
        finally:
            inst.accepted -= 1
        SEGMENTS_DECODED.labels("ok").inc()
        return JSONResponse(part.model_dump(mode="json"))

    @app.post("/internal/abort/{request_id}")
    async def abort(request_id: str) -> dict[str, Any]:
        return {"aborted": request_id, "leases": holder["v"].leases.cancel_owner(request_id)}

    return app


def cli_main(args: argparse.Namespace) -> int:
    """`triptych worker --role V`: the same flags and tokens as any worker."""
    import uvicorn

    from triptych.listen_socket import adopt

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sys.setswitchinterval(0.001)  # decoder threads and the event loop share the GIL
    settings = settings_from_args(args)
    try:
        auth = WorkerAuth.load(args.internal_token_file, args.admin_token_file, args.insecure_no_auth)
    except MissingTokenError as exc:
        raise SystemExit(str(exc)) from exc
    app = create_video_app(settings, auth)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=30)
    DrainingServer(config, _Lazy(app)).run(sockets=[adopt(args.fd)] if args.fd is not None else None)
    return 0


class _Lazy:
    """The app's instance, built in its lifespan (after the server starts): a signal before
    that finds nothing to drain."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    def _inst(self) -> VideoDecoderInstance | None:
        return getattr(self.app.state, "instance", None)

    def begin_drain(self) -> bool:
        inst = self._inst()
        return inst is not None and inst.begin_drain()

    async def drain(self) -> None:
        inst = self._inst()
        if inst is not None:
            await inst.drain()
