"""One instance's role lifecycle: build the engine, transfer engine and migration service
a role needs, switch roles while up (drain, tear down, load), and report status, load and
stats. The HTTP surface (server.py) and the stage run (stage_run.py) read it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from pathlib import Path
from typing import Any

from triptych.topology import UNASSIGNED, InstanceType, Stage
from triptych.worker.admission import DecodePool
from triptych.worker.engine.engine import Engine, EngineConfig
from triptych.worker.engine.role_change import (
    drops_caches,
    drops_language_later,
    keeps_handovers,
    preload_parts,
    same_parts,
)
from triptych.worker.engine.token_feed import TokenFeed
from triptych.worker.live_switch import await_moved_out, language_work, switch_live
from triptych.worker.migration import MigrationService
from triptych.worker.models.vision import warm_imports
from triptych.worker.settings import WorkerSettings
from triptych.worker.transfer import TransferEngine
from triptych.worker.video_pull import VideoPuller
from triptych.worker.waits import wait_for

log = logging.getLogger("triptych.worker.instance")

TAKEOVER_RECORDS = 64  # `/admin/stats` `recent_takeovers`: enough for a switch that moves a full batch


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
        self.switching = False  # offload -> migrate -> onload under way (see switch)
        self.target_role: str | None = None
        self.inflight = 0
        self.preparing = 0  # stage runs pulling their inputs (not yet in the engine)
        # Staging for video patches pulled from V instances (allocated at the first such video).
        self.transfer_bytes: dict[str, int] = {}  # transport -> bytes pulled, across roles
        self.video_puller = VideoPuller(settings.video_buffer_mb << 20, self.transfer_bytes)
        self._switch_lock = asyncio.Lock()
        # The last in-place switch's hand-overs: how many it left parked, and when the last
        # was pulled (seconds from the switch's start; None while one is pending).
        self.last_switch: dict[str, Any] = {}
        self.parked_at: float | None = None  # when a switch last parked its decodes (time.time())
        # The last decodes that moved here mid-stream, each hop's moments (worker/takeover.py).
        self.takeovers: deque[dict[str, Any]] = deque(maxlen=TAKEOVER_RECORDS)
        # Takeovers here being fed their source's tokens, by request id (until their runs end).
        self.feeds: dict[str, TokenFeed] = {}
        self._handover_task: asyncio.Task[None] | None = None
        self.moving_out: asyncio.Task[None] | None = None  # a live switch's decodes leaving (live_switch.py)
        # Migration services (and their transfer agents) of caches a switch dropped while
        # hand-overs in them were still to be pulled (`_retire`): their leases stay live.
        self._retired: list[MigrationService] = []
        self._retiring: set[asyncio.Task[None]] = set()
        # Image decode and preprocessing run here, never on the event loop (admission.py).
        self.decode_pool = DecodePool(settings.decode_threads, settings.decode_queue)

    # -- role --------------------------------------------------------------------------
    def _build(self, role: InstanceType) -> tuple[Engine, TransferEngine, MigrationService]:
        s = self.settings
        engine = Engine(EngineConfig(model=s.model, role=role, dtype=s.dtype, device=s.device,
                                     block_size=s.block_size, num_kv_blocks=s.num_kv_blocks,
                                     enable_prefix_caching=s.enable_prefix_caching,
                                     parallel_vision=s.parallel_vision,
                                     num_mm_blocks=s.num_mm_blocks, max_model_len=s.max_model_len,
                                     token_budget=s.token_budget, image_budget=s.image_budget,
                                     encode_token_budget=s.encode_token_budget,
                                     ttft_slo_s=s.ttft_slo_s, tbt_slo_s=s.tbt_slo_s, keep_mm_cache=True,
                                     compile_decode=s.compile_decode, cpus=s.engine_cpus,
                                     stream_interval=s.stream_interval))
        transfer, migration = self._wire_transfer(engine, self._new_agent(role))
        if not role.needs_vision:  # a later switch to E loads the vision tower without the imports' wait
            warm_imports(engine.spec, Path(s.model))
        engine.start()
        return engine, transfer, migration

    def _new_agent(self, role: InstanceType) -> TransferEngine:
        return TransferEngine(f"{self.settings.instance_id}-{role.value}", require=self.settings.transfer_require)

    def _needs_new_agent(self, role: InstanceType) -> bool:
        """Whether dropping a cache needs a fresh agent: hand-overs read it under lease (now, or
        once the old role's work moves out), and the old agent retires with them (`_retire`).
        Else it lets the region go in place (a NIXL agent: 30-130 ms of CPU, 50-430 ms at 0.25)."""
        assert self.engine is not None and self.migration is not None
        return drops_caches(self.engine, role) and bool(self.migration.leases.outstanding() or language_work(self.engine))

    def _wire_transfer(self, engine: Engine, transfer: TransferEngine) -> tuple[TransferEngine, MigrationService]:
        s = self.settings
        if engine.kv is not None:
            transfer.register("kv", engine.kv.tensor)
        if engine.mm is not None:
            transfer.register("mm", engine.mm.tensor)
        migration = MigrationService(engine, transfer, lease_seconds=s.lease_seconds,
                                     pull_timeout_s=s.pull_timeout_s, bytes_pulled=self.transfer_bytes,
                                     lease_margin_s=s.lease_margin_s)
        return transfer, migration

    async def switch(self, role: str) -> dict[str, Any]:
        """Serve `role`. A running engine changes role in place (EPDServe §3.2.4): offload
        (stop taking work, hand back queued requests not started), migrate (in-flight
        prefills finish, decodes move to another decode instance), onload (keep what the new
        role shares, load or free only the part it adds or drops). Returns each phase's
        seconds and how many requests were migrated and handed back."""
        async with self._switch_lock:
            if role == self.role:
                return _report(0.0, 0.0, 0.0, 0, 0)
            waited = await await_moved_out(self)  # the previous switch's decodes (live_switch.py)
            started = time.monotonic()
            self.switching, self.target_role = True, role
            try:
                if self.engine is None or role == UNASSIGNED:
                    return await self._rebuild(role, started)
                if self.settings.live_switch and self._switches_live(InstanceType(role)):
                    return {**await switch_live(self, InstanceType(role), started), "waited_s": round(waited, 6)}
                before = dict(self.engine.scheduler.counters.as_dict())
                # A switch that keeps the caches (P <-> D keeps the KV cache, E -> P/D the MM
                # cache): hand-overs parked in them (migrated decodes, prefills' KV, encodes'
                # embeddings) need not be pulled before the new role serves; they stay under
                # their leases and are released on confirm or expiry (`_follow_handover`).
                keep_parked = keeps_handovers(self.engine, InstanceType(role))
                # The weights the new role adds load while the old role's work still runs
                # and moves out (its decodes' pre-copy): onload then only swaps them in.
                preload = asyncio.create_task(self._preload(InstanceType(role)))
                try:
                    precopy_s = await self._offload()
                    offloaded = time.monotonic()
                    moved = await self._migrate(keep_parked)
                    migrated = time.monotonic()
                    streamed = {i: self.engine.output.moved_out[i] for i in moved if i in self.engine.output.moved_out}
                    released = {i: self.engine.output.released[i] for i in moved if i in self.engine.output.released}
                    pending = self.engine.parked_ids()
                    preloaded, agent, preload_s = await asyncio.shield(preload)
                except BaseException:  # a failed switch: what the preload built goes, once it ends
                    preload.add_done_callback(_close_agent)
                    raise
                loaded = time.monotonic()
                await self._onload(InstanceType(role), preloaded, agent)
                after = self.engine.scheduler.counters.as_dict()
                self.role = role
                self._follow_handover(pending, moved, streamed, started, migrated)
                self.last_switch["released_tokens"] = released
                log.info("instance %s now serves role %s (in place)", self.settings.instance_id, role)
                # onload_s: the wait for the preload to end (past the migrate phase) and the swap.
                return {**_report(offloaded - started - precopy_s, migrated - offloaded, time.monotonic() - migrated,
                                  after["migrated_out"] - before["migrated_out"],
                                  after["handed_back"] - before["handed_back"], precopy_s),
                        "handover_pending": len(pending), "preload_s": round(preload_s, 6),
                        "swap_s": round(time.monotonic() - loaded, 6)}
            finally:
                self.switching, self.target_role = False, None

    def _switches_live(self, role: InstanceType) -> bool:
        """P <-> D, and a switch to E while the language model has work in flight (its
        prefills and decodes leave after the reply: live_switch.py)."""
        assert self.engine is not None
        return same_parts(self.engine, role) or (drops_language_later(self.engine, role) and bool(
            self.preparing or language_work(self.engine)))

    async def _rebuild(self, role: str, started: float) -> dict[str, Any]:
        """From or to unassigned: drain, tear down, build what `role` needs."""
        await self.drain()
        drained = time.monotonic()
        self.teardown()
        if role != UNASSIGNED:
            self.loading = True
            try:
                built = await asyncio.to_thread(self._build, InstanceType(role))
            finally:
                self.loading = False
            self.engine, self.transfer, self.migration = built
            self.migration.start()
        self.role = role
        log.info("instance %s now serves role %s", self.settings.instance_id, role)
        return _report(0.0, drained - started, time.monotonic() - drained, 0, 0)

    async def _offload(self) -> float:
        """Hand back queued requests (their runs end with a retriable 503 before their first
        token) and start migrating decodes out; returns once the engine has done both, and
        the seconds the decodes' pre-copy took (`_precopy`)."""
        engine = self.engine
        assert engine is not None
        decodes = engine.role.runs(Stage.DECODE)
        precopy_s = await self._precopy() if decodes else 0.0
        self.parked_at = time.time() if decodes else None  # wall clock (last_switch.parked_at)
        engine.offload(migrate=decodes)
        await self._inbox_taken(engine)
        return precopy_s

    async def _inbox_taken(self, engine: Engine) -> None:
        await wait_for(lambda: not engine.has_pending_inbox, self.settings.drain_timeout_s)

    async def _precopy(self) -> float:
        """Live migration's pre-copy (Clark et al., "Live Migration of Virtual Machines",
        NSDI '05 §3: iterative pre-copy, then stop-and-copy of what is left): hand back
        queued work, then every running decode offers its full KV blocks (its stream sends
        a `precopy` event; the router has the decode's next instance pull them) and keeps
        decoding here. Returns once every offer was pulled — or `precopy_timeout_s` passed
        (a slow or failed target: the hand-over then pulls what it lacks) — in seconds.
        The hand-over that follows moves only the blocks filled since (the last, partial
        one), so a moved stream pauses for a small pull, not for all of its KV."""
        engine, migration = self.engine, self.migration
        timeout = self.settings.precopy_timeout_s
        if engine is None or migration is None or timeout <= 0:
            return 0.0
        started = time.monotonic()
        engine.offload(migrate=False)
        engine.precopy()
        await self._inbox_taken(engine)
        await wait_for(lambda: not (engine.precopies_waiting()
                                    or migration.precopies_outstanding(live=engine.running_decodes())),
                       started + timeout - time.monotonic())
        return time.monotonic() - started

    async def _migrate(self, keep_parked: bool) -> list[str]:
        """Wait until every request has left the engine (prefills finished and handed over,
        decodes parked and their `migrating` event sent to the router) and every stage run
        has ended; unless `keep_parked`, also until every hand-over was pulled. Returns the
        ids of the decodes migrated out."""
        engine = self.engine
        assert engine is not None
        deadline = time.monotonic() + self.settings.drain_timeout_s
        moved: set[str] = set()

        def busy() -> bool:
            moved.update(engine.parked_ids(Stage.DECODE), engine.live_handovers())
            held = engine.request_ids(parked=not keep_parked)
            return bool(held or self.inflight or self.preparing or (not keep_parked and self.leases_outstanding()))

        await wait_for(lambda: not busy(), deadline - time.monotonic(), 0.002)
        if self.migration is not None and self.leases_outstanding() and not keep_parked:
            log.warning("switch: %d leases unconfirmed after %.0fs; freeing them", self.leases_outstanding(),
                        self.settings.drain_timeout_s)
            self.migration.free_all()
        for request_id in engine.request_ids(parked=not keep_parked):
            log.warning("switch: aborting request %s that did not finish in time", request_id)
            self.abort(request_id)
        await wait_for(lambda: not engine.request_ids(parked=not keep_parked), deadline + 5.0 - time.monotonic(), 0.005)
        return sorted(moved)

    def _follow_handover(self, pending: list[str], moved: list[str], streamed: dict[str, int], started: float,
                         migrated: float) -> None:
        """Time the hand-overs a switch left parked until their pulls confirm (or their
        leases expire): `/admin/stats` `last_switch` says when the last one went, which
        decodes moved (their request ids: a benchmark tells the migrated streams by them)
        and how many tokens each had streamed here (`moved_tokens`: the next one came from
        its new instance)."""
        # With nothing left parked, the hand-overs were pulled within the migrate phase.
        self.last_switch = {"handover_pending": len(pending),
                            "handover_s": round(migrated - started, 6) if not pending else None,
                            "migrated_ids": moved, "moved_tokens": streamed, "parked_at": self.parked_at}
        if not pending:
            return
        record = self.last_switch

        async def follow() -> None:
            engine = self.engine

            def pulled() -> bool:  # or the engine went: nothing to follow
                return engine is not self.engine or engine is None or not set(pending) & set(
                    engine.request_ids()) and not any(m.leases.outstanding() for m in self._retired)

            if await wait_for(pulled, self.settings.lease_seconds + self.settings.drain_timeout_s, 0.005) \
                    and engine is not None and engine is self.engine:
                record["handover_s"] = round(time.monotonic() - started, 6)

        self._handover_task = asyncio.create_task(follow())

    async def _preload(self, role: InstanceType, *, with_agent: bool = True) -> tuple[Any, TransferEngine | None, float]:
        """Off the event loop: the weights `role` adds (role_change.preload_parts) and, when
        the change drops a cache and `with_agent`, the new transfer agent; and the seconds
        that took."""
        engine = self.engine
        assert engine is not None
        started = time.monotonic()

        def load() -> tuple[Any, TransferEngine | None]:
            agent = self._new_agent(role) if with_agent and self._needs_new_agent(role) else None
            try:
                return preload_parts(engine, role), agent
            except BaseException:
                _close(agent)
                raise

        parts, agent = await asyncio.to_thread(load)
        return parts, agent, time.monotonic() - started

    async def _onload(self, role: InstanceType, preloaded: Any = None, agent: TransferEngine | None = None) -> None:
        """Change the engine's role in place; re-register the caches it gained or lost."""
        assert self.engine is not None and self.transfer is not None and self.migration is not None
        try:
            changed = await asyncio.to_thread(self.engine.set_role, role, preloaded)
        except BaseException:
            _close(agent)
            raise
        if changed.caches_dropped and (agent is not None or self.migration.leases.outstanding()):
            self._retire(self.transfer, self.migration)  # it serves the leases on the dropped cache
            self.transfer, self.migration = await asyncio.to_thread(
                self._wire_transfer, self.engine, agent or self._new_agent(role))
            self.migration.start()
            return
        _close(agent)
        for region, cache in (("kv", self.engine.kv), ("mm", self.engine.mm)):
            if f"{region}_cache" in changed.freed:
                self.transfer.deregister(region)
            if f"{region}_cache" in changed.loaded and cache is not None:
                self.transfer.register(region, cache.tensor)

    def _retire(self, transfer: TransferEngine, migration: MigrationService) -> None:
        """Let go of a transfer agent and migration service whose caches the engine dropped.
        Hand-overs still under their leases (decodes and prefills detached by set_role) keep
        being pulled from the dropped cache — its tensor lives on in the agent's
        registration — so the switch does not wait for them; once the last lease is
        confirmed or expires, the agent is closed and the cache's memory goes with it."""
        if not migration.leases.outstanding():
            migration.stop()
            transfer.close()
            return
        self._retired.append(migration)

        async def close_when_released() -> None:
            try:
                # Leases end by themselves (confirmed, or expired after lease_seconds).
                await wait_for(lambda: not migration.leases.outstanding(),
                               self.settings.lease_seconds + self.settings.drain_timeout_s, 0.01)
            finally:
                migration.stop()
                transfer.close()
                self._retired.remove(migration)
                log.info("instance %s: the dropped cache's last hand-over was pulled; freed", self.settings.instance_id)

        task = asyncio.create_task(close_when_released())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    def begin_drain(self) -> bool:
        """A shutdown signal: stop taking work (worker/draining.py); an instance with no
        role holds nothing and exits at once."""
        if self.engine is None:
            return False
        self.draining = True
        return True

    async def drain(self) -> None:
        """Wait (up to drain_timeout_s) for in-flight runs and outstanding hand-overs; then
        free the leases nobody pulled. Running decodes are handed to another decode
        instance (migrated out) rather than waited for."""
        if self.engine is not None and self.engine.role.runs(Stage.DECODE):
            await self._precopy()
            self.engine.offload(migrate=True)
        await wait_for(lambda: not (self.inflight or self.leases_outstanding()), self.settings.drain_timeout_s, 0.05)
        if self.leases_outstanding():
            log.warning("drain timed out with %d leases outstanding; freeing them", self.leases_outstanding())
            for migration in [self.migration, *self._retired]:
                if migration is not None:
                    migration.free_all()

    def teardown(self) -> None:
        for task in list(self._retiring):  # their `finally` closes the retired agents
            task.cancel()
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
        for migration in [self.migration, *self._retired]:
            if migration is not None:
                migration.cancel(request_id)

    # -- views -------------------------------------------------------------------------
    @property
    def status(self) -> str:
        busy = (("switching", self.switching), ("loading", self.loading), ("draining", self.draining))
        return next((name for name, on in busy if on), "ok" if self.engine is not None else "unassigned")

    @property
    def transport(self) -> str | None:
        return self.transfer.transport if self.transfer is not None else None

    def leases_outstanding(self) -> int:
        """Leases of this role's migration service and of any a switch retired (`_retire`)."""
        current = self.migration.leases.outstanding() if self.migration is not None else 0
        return current + sum(m.leases.outstanding() for m in self._retired)

    def load(self) -> float:
        if self.engine is None:
            return 0.0
        stats = self.engine.stats()
        return float(stats["num_waiting"] + stats["num_running"])

    def stats(self) -> dict[str, Any]:
        base: dict[str, Any] = {
            "role": self.role, "instance_id": self.settings.instance_id, "status": self.status,
            "inflight": self.inflight, "leases_outstanding": self.leases_outstanding(),
            "last_switch": dict(self.last_switch), "recent_takeovers": [dict(r) for r in self.takeovers],
            "transport": self.transport, "transfer_bytes": dict(self.transfer_bytes)}
        if self.engine is not None:
            base.update(self.engine.stats())
        return base


def _close(agent: TransferEngine | None) -> None:
    if agent is not None:
        agent.close()


def _close_agent(task: asyncio.Task[tuple[Any, TransferEngine | None, float]]) -> None:
    """A failed switch's preload: the agent it built, if any, goes."""
    if not task.cancelled() and task.exception() is None:
        _close(task.result()[1])


def _report(offload_s: float, migrate_s: float, onload_s: float, migrated: int, handed_back: int,
            precopy_s: float = 0.0) -> dict[str, Any]:
    """What `/admin/role` answers: each phase's seconds and what moved. `precopy_s` (the
    moved decodes' pre-copy, while they still decode here) is a part of offload, counted
    apart: `offload_s` is the rest of it."""
    total = precopy_s + offload_s + migrate_s + onload_s
    return {"precopy_s": round(precopy_s, 6), "offload_s": round(offload_s, 6), "migrate_s": round(migrate_s, 6),
            "onload_s": round(onload_s, 6), "total_s": round(total, 6), "migrated": migrated,
            "handed_back": handed_back}
