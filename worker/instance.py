"""One instance's role lifecycle: build the engine, transfer engine and migration service
a role needs, switch roles while up (drain, tear down, load), and report status, load and
stats. The HTTP surface (server.py) and the stage run (stage_run.py) read it."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from triptych.topology import UNASSIGNED, InstanceType
from triptych.worker.admission import DecodePool
from triptych.worker.engine.engine import Engine, EngineConfig
from triptych.worker.migration import MigrationService
from triptych.worker.settings import WorkerSettings
from triptych.worker.transfer import TransferEngine

log = logging.getLogger("triptych.worker.instance")


class InstanceRuntime:
    """The engine, transfer engine and migration service of the current role; swapped
    whole on a role switch."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.role: str = UNASSIGNED
        self.engine: Engine | None = None
        self.transfer: TransferEngine | None = None
        self.migration: MigrationService | None = None
        self.loading = False
        self.draining = False
        self.inflight = 0
        self.transfer_bytes: dict[str, int] = {}  # transport -> bytes pulled, across roles
        self._switch_lock = asyncio.Lock()
        # Image decode and preprocessing run here, never on the event loop (admission.py).
        self.decode_pool = DecodePool(settings.decode_threads, settings.decode_queue)

    # -- role --------------------------------------------------------------------------
    def _build(self, role: InstanceType) -> tuple[Engine, TransferEngine, MigrationService]:
        s = self.settings
        engine = Engine(EngineConfig(model=s.model, role=role, dtype=s.dtype, device=s.device,
                                     block_size=s.block_size, num_kv_blocks=s.num_kv_blocks,
                                     num_mm_blocks=s.num_mm_blocks, max_model_len=s.max_model_len,
                                     token_budget=s.token_budget, image_budget=s.image_budget,
                                     ttft_slo_s=s.ttft_slo_s, tbt_slo_s=s.tbt_slo_s))
        transfer = TransferEngine(f"{s.instance_id}-{role.value}", require=s.transfer_require)
        if engine.kv is not None:
            transfer.register("kv", engine.kv.tensor)
        if engine.mm is not None:
            transfer.register("mm", engine.mm.tensor)
        migration = MigrationService(engine, transfer, lease_seconds=s.lease_seconds,
                                     pull_timeout_s=s.pull_timeout_s, bytes_pulled=self.transfer_bytes,
                                     lease_margin_s=s.lease_margin_s)
        engine.start()
        return engine, transfer, migration

    async def switch(self, role: str) -> None:
        """Drain in-flight work, drop the old engine, load what `role` needs."""
        async with self._switch_lock:
            if role == self.role:
                return
            self.draining = True
            try:
                await self.drain()
                self.teardown()
                if role != UNASSIGNED:
                    self.loading = True
                    built = await asyncio.to_thread(self._build, InstanceType(role))
                    self.engine, self.transfer, self.migration = built
                    self.migration.start()
                self.role = role
                log.info("instance %s now serves role %s", self.settings.instance_id, role)
            finally:
                self.loading = False
                self.draining = False

    async def drain(self) -> None:
        """Wait (up to drain_timeout_s) for in-flight runs and outstanding hand-overs; then
        free the leases nobody pulled."""
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while (self.inflight or self.leases_outstanding()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.migration is not None and self.leases_outstanding():
            log.warning("drain timed out with %d leases outstanding; freeing them", self.leases_outstanding())
            self.migration.free_all()

    def teardown(self) -> None:
        if self.migration is not None:
            self.migration.stop()
            self.migration = None
        if self.engine is not None:
            self.engine.stop()
            self.engine = None
        if self.transfer is not None:
            self.transfer.close()
            self.transfer = None

    def abort(self, request_id: str) -> None:
        """Stop a request here: the engine frees its blocks, and a hand-over it offered is
        withdrawn (its leases released now, not at expiry)."""
        if self.engine is not None:
            self.engine.abort(request_id)
        if self.migration is not None:
            self.migration.cancel(request_id)

    # -- views -------------------------------------------------------------------------
    @property
    def status(self) -> str:
        if self.loading:
            return "loading"
        if self.draining:
            return "draining"
        return "ok" if self.engine is not None else "unassigned"

    @property
    def transport(self) -> str | None:
        return self.transfer.transport if self.transfer is not None else None

    def leases_outstanding(self) -> int:
        return self.migration.leases.outstanding() if self.migration is not None else 0

    def load(self) -> float:
        if self.engine is None:
            return 0.0
        stats = self.engine.stats()
        return float(stats["num_waiting"] + stats["num_running"])

    def stats(self) -> dict[str, Any]:
        base: dict[str, Any] = {"role": self.role, "instance_id": self.settings.instance_id,
                                "status": self.status, "inflight": self.inflight,
                                "leases_outstanding": self.leases_outstanding(),
                                "transport": self.transport,
                                "transfer_bytes": dict(self.transfer_bytes)}
        if self.engine is not None:
            base.update(self.engine.stats())
        return base
