"""A P <-> D role switch that answers as soon as the instance runs its new role (EPDServe
§3.2.4's offload -> migrate -> onload, with the migrate phase moved behind the reply).

The weights and the KV cache stay, so nothing has to leave the engine before the new role
serves: offload (queued work not started is handed back, runs pulling their inputs land),
start the decodes' pre-copy (Clark et al., NSDI '05 §3), and change the role in place
(`Engine.set_role` keeps the running requests; admission follows the new role, so no new
decode is taken). The switch replies then. The old role's decodes keep decoding here while
their next instance pulls their full KV blocks; once every pre-copy is confirmed or
`precopy_timeout_s` passed they move out at the next step boundary (`move_out`): parked and
handed over, or handed over live and decoding on here until the router cuts over to their
next instance (make-before-break, worker/engine/token_feed.py), and `/admin/stats` `last_switch` records `precopy_s`, `handover_s` and
`migrated_ids` when that is done (with `released_tokens`, for decodes handed over live:
the tokens each had here when its stream let go). A second switch of the same instance waits for this one's
decodes to have moved out (`await_moved_out`) and reports that wait as `waited_s`.

A switch to E from a role with a language model (D, P, ...) runs live the same way when
that model still has work in flight (role_change.drops_language_later): the vision tower
loads while the old role's work goes on (the preload), joins the parts held
(`Engine.join_parts`), and the switch replies; the old role's decodes move out as above,
its prefills finish here, and then the language model and its KV cache are let go
(`drop_language`: a moment in which the instance says `switching` and takes no new stage
run, so the transfer agent that registered the KV cache can let it go). `last_switch`
records when (`parts_freed_s`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from triptych.topology import InstanceType, Stage
from triptych.worker.engine.role_change import same_parts
from triptych.worker.waits import wait_for

if TYPE_CHECKING:
    from triptych.worker.engine.engine import Engine
    from triptych.worker.instance import InstanceRuntime
    from triptych.worker.transfer import TransferEngine

log = logging.getLogger("triptych.worker.live_switch")

# Test-only: hold the old role's decodes this long before they move out, so a test can catch
# a second switch while the first one's hand-over is still under way. Unset in production.
MOVE_OUT_DELAY_ENV = "TRIPTYCH_TEST_MOVE_OUT_DELAY_S"


def leaving_decodes(engine: Engine, role: InstanceType) -> list[str]:
    """Decodes in the engine (not parked) that `role` does not run: they must move out."""
    return [] if role.runs(Stage.DECODE) else running_with(engine, {Stage.DECODE})


def language_work(engine: Engine) -> list[str]:
    """Requests in the engine (not parked) that run the language model: a prefill or a decode."""
    return running_with(engine, {Stage.PREFILL, Stage.DECODE})


def running_with(engine: Engine, stages: set[Stage]) -> list[str]:
    """Requests in the engine (not parked; adds still in its inbox too) that run any of `stages`."""
    ids = []
    for request_id in engine.request_ids(parked=False):
        req = engine.get_request(request_id)  # None: ended meanwhile
        if req is not None and stages & req.stages:
            ids.append(request_id)
    return ids


async def switch_live(inst: InstanceRuntime, role: InstanceType, started: float) -> dict[str, Any]:
    """Offload and onload now; the old role's decodes move out in the background (and,
    for a switch that drops the language model, that model goes once its work has left)."""
    engine = inst.engine
    assert engine is not None
    s = inst.settings
    before = dict(engine.scheduler.counters.as_dict())
    grows = not same_parts(engine, role)  # the vision tower joins now; the language model goes later
    # The transfer agent that replaces the KV cache's is built later (drop_language), not
    # before the reply: at a quarter of a core it took longer than the vision tower.
    preload = asyncio.create_task(inst._preload(role, with_agent=False)) if grows else None
    # Neither needs the engine's next step boundary before the role changes (that would
    # cost a step of the running decodes): the engine hands back queued work and asks its
    # running decodes for their pre-copy there, whatever its role by then.
    engine.offload(migrate=False)  # hand back queued work not started
    if s.precopy_timeout_s > 0 and not role.runs(Stage.DECODE):
        engine.precopy()
    old_role = engine.role
    # A run pulling its inputs joins the engine first: a decode among them moves out with
    # the rest. To a role that decodes (P -> D) nothing moves out: such runs land after the
    # reply instead (`_land`), and the switch need not wait for their pulls.
    landing = role.runs(Stage.DECODE) and not grows and inst.preparing > 0
    if not landing:
        await wait_for(lambda: not inst.preparing, s.drain_timeout_s)
    leaving = leaving_decodes(engine, role)
    offloaded = time.monotonic()
    preload_s = await _take_role(engine, role, preload)
    if landing:  # admission takes what the old role ran too, until those runs are in
        engine.admission.role = InstanceType("".join(c for c in "EPD" if c in old_role.value + role.value))
    # A decode hop whose stream added it to the engine after the wait above (its inputs
    # were pulled, its stream had not started) was admitted under the old role: it moves
    # out with the rest. Any added from now on is refused (503: the router goes elsewhere).
    leaving = sorted({*leaving, *leaving_decodes(engine, role)})
    onloaded = time.monotonic()
    after = engine.scheduler.counters.as_dict()
    inst.role = role.value
    record: dict[str, Any] = {"handover_pending": len(leaving), "precopy_s": None,
                              "handover_s": round(onloaded - started, 6) if not leaving else None,
                              "migrated_ids": [], "moved_tokens": {}}
    inst.last_switch = record
    if leaving or grows or landing:
        inst.moving_out = asyncio.create_task(_leave(inst, engine, role, leaving, started, record, landing, grows))
    log.info("instance %s now serves role %s (live; %d decodes moving out)", s.instance_id, role.value, len(leaving))
    return {"precopy_s": 0.0, "offload_s": round(offloaded - started, 6), "migrate_s": 0.0,
            "onload_s": round(onloaded - offloaded, 6), "total_s": round(onloaded - started, 6),
            "migrated": len(leaving), "handed_back": after["handed_back"] - before["handed_back"],
            "handover_pending": len(leaving), "migrating": len(leaving),
            **({"preload_s": round(preload_s, 6)} if grows else {})}


async def _take_role(engine: Engine, role: InstanceType,
                     preload: asyncio.Task[tuple[Any, TransferEngine | None, float]] | None) -> float:
    """Change the engine's role in place with its requests running. Same parts
    (role_change.same_parts): at once unless a step holds the engine right now — a thread
    hop on a capped instance waits for its quota's next period: it made a loaded P <-> D
    switch take 10-120 ms at 0.25 CPU (docs/benchmarks.md). Otherwise the vision tower the
    preload loaded joins the parts held. Returns the preload's seconds."""
    if preload is None:
        if engine.set_role(role, wait=False) is None:
            await asyncio.to_thread(engine.set_role, role)
        return 0.0
    try:
        parts, _agent, preload_s = await asyncio.shield(preload)  # no agent: with_agent=False
    except BaseException:  # the instance keeps its role; its decodes stay and stop offering pre-copies
        engine.precopy_armed = False
        raise
    engine.join_parts(role, parts)
    return preload_s


async def _leave(inst: InstanceRuntime, engine: Engine, role: InstanceType, leaving: list[str],
                 started: float, record: dict[str, Any], landing: bool, grows: bool) -> None:
    """What a live switch leaves behind it: runs of the old role still pulling their
    inputs land, the old role's decodes move out, and a switch that drops the language
    model frees it once its work has left."""
    if landing:
        await _land(inst, engine, role)
    if leaving:
        await move_out(inst, engine, leaving, started, record)
    if grows:
        await drop_language(inst, engine, role, started, record)


async def _land(inst: InstanceRuntime, engine: Engine, role: InstanceType) -> None:
    """Once the runs that were pulling their inputs when the role changed are in the engine
    (bounded by drain_timeout_s: a run still pulling then is refused, 503, and the router
    retries it elsewhere), admission follows the new role alone. No new run of the old
    role starts meanwhile: a stage run checks the engine's role before it pulls
    (stage_run.prepare)."""
    try:
        await wait_for(lambda: inst.engine is not engine or not inst.preparing, inst.settings.drain_timeout_s)
    finally:
        if engine.role is role:
            engine.admission.role = role


async def drop_language(inst: InstanceRuntime, engine: Engine, role: InstanceType, started: float,
                        record: dict[str, Any]) -> None:
    """Once the old role's prefills and decodes have left (bounded by drain_timeout_s;
    what is left then is aborted), free the language model and its KV cache: with leases
    still on that cache a new transfer agent is built (in a thread) to replace the one that
    registered it (`InstanceRuntime._needs_new_agent`; else that one deregisters it), the
    instance says `switching` and takes no new stage run (the router sends them elsewhere)
    while the runs under way end, then `set_role` drops the parts and the new agent takes
    over (the old one's leases live on: `InstanceRuntime._retire`)."""
    s = inst.settings
    agent: TransferEngine | None = None

    def current() -> bool:
        return inst.engine is engine and not inst.draining

    try:
        if not await wait_for(lambda: not current() or not language_work(engine), s.drain_timeout_s, 0.005):
            for request_id in language_work(engine):
                log.warning("switch: aborting request %s that did not leave in time", request_id)
                inst.abort(request_id)
        if current() and inst._needs_new_agent(role):
            agent = await asyncio.to_thread(inst._new_agent, role)
        if not current():
            return
        inst.switching, inst.target_role = True, role.value
        try:
            if not await wait_for(lambda: not (inst.inflight or inst.preparing or engine.request_ids(parked=False)),
                                  s.drain_timeout_s, 0.002):
                for request_id in engine.request_ids(parked=False):
                    log.warning("switch: aborting request %s that did not end in time", request_id)
                    inst.abort(request_id)
                await wait_for(lambda: not engine.request_ids(parked=False), 5.0, 0.005)
            taken, agent = agent, None
            await inst._onload(role, None, taken)
            record["parts_freed_s"] = round(time.monotonic() - started, 6)
            log.info("instance %s: the language model went with its last work", s.instance_id)
        finally:
            inst.switching, inst.target_role = False, None
    except Exception:  # the instance serves on as it is: the parts stay until the next switch
        log.exception("switch: freeing the language model failed")
    finally:
        if agent is not None:
            agent.close()


async def move_out(inst: InstanceRuntime, engine: Engine, leaving: list[str], started: float,
                   record: dict[str, Any]) -> None:
    """Pre-copy wait, then park the old role's decodes at the next step boundary and follow
    their hand-overs until each was pulled (its lease confirmed: the engine lets it go) or
    its lease expired. Decodes that finished here meanwhile simply are not among
    `migrated_ids`."""
    s = inst.settings
    migration = inst.migration

    def current() -> bool:
        return inst.engine is engine

    try:
        await asyncio.sleep(float(os.environ.get(MOVE_OUT_DELAY_ENV, "0") or 0))
        # The pre-copy was asked for at the switch's start: its bound counts from there (a
        # switch to E replies only once the vision tower it preloads is in).
        await wait_for(lambda: not current() or not (engine.precopies_waiting() or (
            migration is not None and migration.precopies_outstanding())),
            started + s.precopy_timeout_s - time.monotonic())
        record["precopy_s"] = round(time.monotonic() - started, 6)
        if not current():
            return
        record["parked_at"] = time.time()  # wall clock: a client finds its stream's hop by it
        engine.park_decodes()
        left = set(leaving)

        def staying() -> set[str]:  # neither parked nor handed over live (those go on until let go)
            return left & set(engine.request_ids(parked=False)) - engine.live_handovers()

        if not await wait_for(lambda: not current() or not staying(), s.drain_timeout_s, 0.002):
            for request_id in staying():
                log.warning("switch: aborting decode %s that did not park in time", request_id)
                inst.abort(request_id)
        moved = set(engine.output.moved_out) & left
        record["migrated_ids"] = sorted(moved)
        record["moved_tokens"] = {i: engine.output.moved_out[i] for i in moved}
        # Each hand-over is released when its pull confirms (or its lease expires).
        await wait_for(lambda: not current() or not moved & set(engine.request_ids()),
                       s.lease_seconds + s.drain_timeout_s, 0.002)
        record["handover_s"] = round(time.monotonic() - started, 6)
        record["handover_pending"] = len(moved & set(engine.request_ids()))
        record["released_tokens"] = {i: engine.output.released[i] for i in moved if i in engine.output.released}
    finally:
        if current() and not inst.draining:
            engine.migrating_out = False  # the new role's own decodes (if any) stay here


async def await_moved_out(inst: InstanceRuntime) -> float:
    """A switch requested while the previous one's decodes still move out waits for them
    (bounded by that move's own timeouts); returns the seconds it waited."""
    task = inst.moving_out
    if task is None or task.done():
        return 0.0
    started = time.monotonic()
    await asyncio.wait({task})  # its own errors are its own (logged by asyncio), not this switch's
    return time.monotonic() - started
