"""Live-migration pre-copy of a running decode between two real engines, each with its
own migration service over a real NIXL agent (loopback): while the source goes on
decoding, the target pulls the full KV blocks into its prefix cache; the hand-over after
the source stops then pulls only the blocks filled since, and the decode continues with
exactly the tokens of an uninterrupted run (greedy and seeded). Every failure path ends
with no block or lease held on either side."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from engine_cases import make_cases, processor, to_request
from polling import eventually

from triptych.sampling_params import SamplingParams
from triptych.stage_protocol import FeedRequest, KVSource
from triptych.topology import InstanceType, Stage
from triptych.worker import takeover
from triptych.worker.engine import Engine, EngineConfig, PrefilledKV, RequestStatus
from triptych.worker.engine.request import FinishReason, Request
from triptych.worker.engine.token_feed import TokenFeed
from triptych.worker.migration import HandoffExpiredError, MigrationService
from triptych.worker.transfer import TransferEngine

pytestmark = pytest.mark.usefixtures("one_thread")
PD = {Stage.PREFILL, Stage.DECODE}


def _engine(model_dir: Path, role: InstanceType = InstanceType.PD, block_size: int = 8) -> Engine:
    # Small blocks: a short prompt plus a few tokens fills several, so the pre-copy has
    # full blocks to move and the hand-over a partial one.
    return Engine(EngineConfig(model=str(model_dir), role=role, shuffle_seed=3, num_kv_blocks=96,
                               num_mm_blocks=64, mm_block_rows=8, block_size=block_size))


@dataclass
class Side:
    engine: Engine
    transfer: TransferEngine
    service: MigrationService


def _side(engine: Engine, name: str, lease_seconds: float = 30.0) -> Side:
    transfer = TransferEngine(name, require="nixl")
    transfer.register("kv", engine.kv.tensor)
    service = MigrationService(engine, transfer, lease_seconds=lease_seconds, pull_timeout_s=min(5.0, lease_seconds),
                               lease_margin_s=0.0)
    return Side(engine, transfer, service)


@pytest.fixture
async def pair(qwen2_vl_dir: Path) -> AsyncIterator[tuple[Side, Side]]:
    src, dst = _side(_engine(qwen2_vl_dir), "pc-src"), _side(_engine(qwen2_vl_dir), "pc-dst")
    for side in (src, dst):
        side.service.start()
    try:
        yield src, dst
    finally:
        for side in (src, dst):
            side.service.stop()
            side.transfer.close()



def _run_until(engine: Engine, req, num_outputs: int) -> None:
    while len(req.output_token_ids) < num_outputs:
        engine.step()


def _wire(kv: KVSource) -> KVSource:
    """As the router carries it: through JSON."""
    return KVSource.model_validate_json(kv.model_dump_json())


def _precopy_offer(src: Side, request_id: str) -> KVSource:
    """The source side of a pre-copy: the engine marks the decode, its stream holds the
    full blocks and offers them (stage_run._precopy)."""
    src.engine.precopy()
    outs = src.engine.step()
    assert any(o.precopy and o.request_id == request_id for o in outs)
    held = src.engine.hold_full_kv(request_id)
    assert held is not None and held.num_tokens % src.engine.kv.block_size == 0
    return _wire(src.service.offer_precopy(request_id, held))


def _decoding_with_precopy_offered(model_dir: Path, src: Side) -> tuple[Request, KVSource]:
    """A greedy text decode "x" six tokens in at `src`, its full blocks offered for pre-copy."""
    case = next(c for c in make_cases(8) if not c.images)
    req = to_request(processor(model_dir), case, "x",
                     SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), stages=PD)
    src.engine.add_request(req)
    _run_until(src.engine, req, 6)
    return req, _precopy_offer(src, "x")


def _uninterrupted(model_dir: Path, temperature: float) -> tuple[Any, Any, SamplingParams, Request]:
    """A text case, its sampling (greedy, or seeded), and its uninterrupted run on one engine."""
    proc = processor(model_dir)
    case = next(c for c in make_cases(8) if not c.images)
    params = SamplingParams(temperature=temperature, seed=91, max_tokens=24, ignore_eos=True)
    (whole,) = _engine(model_dir).generate_batch([to_request(proc, case, "w", params, stages=PD)])
    return proc, case, params, whole


@pytest.mark.parametrize("temperature", [0.0, 0.8])
async def test_a_precopied_decode_pulls_only_its_last_blocks_and_continues_exactly(
        qwen2_vl_dir: Path, pair: tuple[Side, Side], temperature: float) -> None:
    src, dst = pair
    proc, case, params, whole = _uninterrupted(qwen2_vl_dir, temperature)

    req = to_request(proc, case, "x", params, stages=PD)
    src.engine.add_request(req)
    _run_until(src.engine, req, 6)
    kv = _precopy_offer(src, "x")
    full = kv.num_tokens // src.engine.kv.block_size
    assert full >= 2 and kv.first_token == (req.prompt_token_ids + req.output_token_ids)[kv.num_tokens]

    pulled, already = await dst.service.precopy_kv(kv, req.prompt_token_ids, req.mm_items)
    assert (pulled, already) == (full, 0)
    assert dst.engine.kv.num_used == 0 and dst.engine.kv.num_cached >= full  # cached, evictable: nothing held
    assert await eventually(lambda: src.service.precopies_outstanding() == 0, timeout_s=10.0)  # confirmed: the hold is gone

    _run_until(src.engine, req, 14)  # the source went on meanwhile (a block or more filled since)
    src.engine.offload(migrate=True)
    outs = src.engine.step()
    handoff = next(o.handoff for o in outs if o.handoff is not None)
    assert handoff.stage == Stage.DECODE and req.status == RequestStatus.PARKED
    tail = src.service.offer_kv("x", handoff.kv_block_ids, handoff.num_kv_tokens, handoff.first_token)
    tail.generated = list(handoff.generated)
    before = dst.service.bytes_pulled.get("nixl-ucx", 0)
    block_ids = await dst.service.pull_kv(_wire(tail), [*req.prompt_token_ids, *tail.generated], req.mm_items)
    rest = len(handoff.kv_block_ids) - full
    assert 0 < rest < len(handoff.kv_block_ids)
    assert dst.service.bytes_pulled["nixl-ucx"] - before == rest * src.engine.kv.bytes_per_block
    for s, d in zip(handoff.kv_block_ids, block_ids, strict=True):
        assert torch.equal(dst.engine.kv.tensor[d], src.engine.kv.tensor[s])

    cont = to_request(proc, case, "x", params, stages={Stage.DECODE},
                      prefilled=PrefilledKV(block_ids, tail.num_tokens, tail.first_token, generated=tail.generated))
    cont.images = {}
    dst.engine.generate_batch([cont])
    assert cont.output_token_ids == whole.output_token_ids
    assert cont.finish_reason == FinishReason.LENGTH and len(cont.output_token_ids) == 24
    assert await eventually(lambda: src.service.leases.outstanding() == 0, timeout_s=10.0)
    src.engine.step()  # the hand-over's release
    assert src.engine.kv.num_used == 0 and dst.engine.kv.num_used == 0
    assert src.engine.request_ids() == [] and dst.engine.request_ids() == []


async def test_a_precopy_lease_holds_its_blocks_past_the_request_and_frees_them_on_expiry(
        qwen2_vl_dir: Path) -> None:
    """Nobody pulls the pre-copy (the target failed or never came) and the decode ends
    meanwhile: its full blocks stay held (a late READ reads what was offered) until the
    lease expires; an abort of the request does not cancel it."""
    src = _side(_engine(qwen2_vl_dir), "pc-exp", lease_seconds=0.5)
    src.service.start()
    try:
        _, kv = _decoding_with_precopy_offered(qwen2_vl_dir, src)
        full = kv.num_tokens // src.engine.kv.block_size
        assert src.engine.running_decodes() == {"x"}
        assert src.service.precopies_outstanding() == 1 == src.service.precopies_outstanding(live={"x"})
        assert src.service.cancel("x") == 0  # an abort leaves the pre-copy lease be
        src.engine.abort("x")
        src.engine.step()
        assert src.engine.request_ids() == [] and src.engine.kv.num_used == full  # the lease's hold only
        # ...but a switch's pre-copy no longer waits for it (nobody will pull it): it waits
        # only for the leases of decodes still running here.
        assert src.engine.running_decodes() == set()
        assert src.service.precopies_outstanding() == 1
        assert src.service.precopies_outstanding(live=src.engine.running_decodes()) == 0
        assert await eventually(lambda: src.service.leases.outstanding() == 0, timeout_s=10.0)
        assert src.engine.kv.num_used == 0
    finally:
        src.service.stop()
        src.transfer.close()


async def test_a_failed_precopy_pull_leaves_nothing_on_the_target(qwen2_vl_dir: Path) -> None:
    """The source's lease is gone before the target reads (it expired: the target was
    slow): the target refuses the handle, frees what it reserved and caches nothing; the
    source holds nothing."""
    src = _side(_engine(qwen2_vl_dir), "pc-late", lease_seconds=0.4)
    dst = _side(_engine(qwen2_vl_dir), "pc-late-dst")
    for side in (src, dst):
        side.service.start()
    try:
        req, kv = _decoding_with_precopy_offered(qwen2_vl_dir, src)
        src.engine.abort("x")
        src.engine.step()
        assert await eventually(lambda: src.service.leases.outstanding() == 0, timeout_s=10.0)  # expired unpulled
        cached = dst.engine.kv.num_cached
        with pytest.raises(HandoffExpiredError):
            await dst.service.precopy_kv(kv, req.prompt_token_ids, req.mm_items)
        assert dst.engine.kv.num_used == 0 and dst.engine.kv.num_cached == cached
        assert src.engine.kv.num_used == 0
    finally:
        for side in (src, dst):
            side.service.stop()
            side.transfer.close()


def test_only_running_decodes_get_a_precopy_and_a_finished_one_holds_nothing(qwen2_vl_dir: Path) -> None:
    proc = processor(qwen2_vl_dir)
    case = next(c for c in make_cases(8) if not c.images)
    e = _engine(qwen2_vl_dir)
    req = to_request(proc, case, "x", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), stages=PD)
    e.add_request(req)
    _run_until(e, req, 3)
    e.precopy()
    outs = e.step()
    assert [o.request_id for o in outs if o.precopy] == ["x"] and e.precopies_waiting() == 1
    e.skip_precopy("x")
    assert e.precopies_waiting() == 0
    _run_until(e, req, 8)
    e.step()
    assert req.status == RequestStatus.FINISHED and e.hold_full_kv("x") is None and e.kv.num_used == 0


def test_a_decode_that_starts_after_the_precopy_request_is_told_too_once(qwen2_vl_dir: Path) -> None:
    # A switch asks for the pre-copy while a decode's KV pull is still in flight; that
    # decode joins the engine after the request and must offer its pre-copy as well (else
    # it moves whole, with no takeover opened for it). Each decode is told once, until the
    # decodes park; a change to a role that keeps its decodes ends it too.
    proc = processor(qwen2_vl_dir)
    cases = [c for c in make_cases(8) if not c.images][:2]
    e = _engine(qwen2_vl_dir)
    e.precopy()
    e.step()
    assert e.precopy_armed
    e.set_role(InstanceType.PD)
    assert not e.precopy_armed
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    first, late = (to_request(proc, c, rid, params, stages=PD) for c, rid in zip(cases, ("a", "b"), strict=True))
    e.add_request(first)
    _run_until(e, first, 3)
    e.precopy()
    assert [o.request_id for o in e.step() if o.precopy] == ["a"]
    e.add_request(late)
    told: list[str] = []
    for _ in range(4):
        told += [o.request_id for o in e.step() if o.precopy]
    assert told == ["b"] and e.precopies_waiting() == 2
    e.precopy()  # a new request (an earlier one's leases may have expired): every decode again
    assert sorted(o.request_id for o in e.step() if o.precopy) == ["a", "b"]
    e.park_decodes()
    e.step()
    assert not e.precopy_armed and not e.precopy_told


def test_a_change_that_drops_the_kv_cache_detaches_its_parked_decodes(qwen2_vl_dir: Path) -> None:
    """D -> E need not wait for its migrated decodes' pulls: set_role detaches them (the
    engine forgets them) and the dropped KV cache keeps their blocks as they were, for
    the old transfer agent to serve until its leases end (InstanceRuntime._retire)."""
    from triptych.worker.engine.role_change import keeps_handovers

    proc = processor(qwen2_vl_dir)
    case = next(c for c in make_cases(8) if not c.images)
    e = _engine(qwen2_vl_dir)
    assert keeps_handovers(e, InstanceType.E) and keeps_handovers(e, InstanceType.P)
    req = to_request(proc, case, "m", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                     stages={Stage.PREFILL, Stage.DECODE})
    e.add_request(req)
    _run_until(e, req, 4)
    e.offload(migrate=True)
    outs = e.step()
    handoff = next(o.handoff for o in outs if o.handoff is not None)
    old = e.kv
    snapshot = old.tensor[torch.tensor(handoff.kv_block_ids)].clone()
    changed = e.set_role(InstanceType.E)
    assert "kv_cache" in changed.freed and e.kv is None
    assert e.parked_ids() == [] and e.request_ids() == []
    assert torch.equal(old.tensor[torch.tensor(handoff.kv_block_ids)], snapshot)
    e.release("m")  # the lease's release once pulled: nothing left to do
    e.step()
    assert e.request_ids() == []


def test_a_takeover_without_its_hand_over_is_refused_and_holds_nothing(qwen2_vl_dir: Path) -> None:
    """The router closes a takeover whose decode ended at its source (or whose client left)
    after the first line: the instance answers 400 and holds no block and no lease — also
    when the pre-copy itself failed (here: a handle that is no handle)."""
    from fastapi.testclient import TestClient

    from triptych.stage_protocol import StageRequest
    from triptych.worker.auth import WorkerAuth
    from triptych.worker.server import create_app
    from triptych.worker.settings import WorkerSettings

    settings = WorkerSettings(model=str(qwen2_vl_dir), role="D", instance_id="d-take", num_kv_blocks=32,
                              block_size=8)
    sreq = StageRequest(request_id="r.t1", stages=[Stage.DECODE], prompt_token_ids=list(range(20, 40)),
                        kv_source=KVSource(handle={"not": "a handle"}, num_tokens=16, first_token=5))
    with TestClient(create_app(settings, WorkerAuth.open())) as client:
        r = client.post("/internal/takeover", content=sreq.model_dump_json() + "\n")
        assert r.status_code == 400 and "no hand-over" in r.json()["error"]["message"]
        r = client.post("/internal/takeover", content="{not json\n")
        assert r.status_code == 400
        stats = client.get("/admin/stats").json()
    assert stats["kv_cache"]["used"] == 0 and stats["leases_outstanding"] == 0 and stats["num_running"] == 0


@pytest.mark.parametrize("temperature", [0.0, 0.8])
async def test_a_decode_handed_over_live_goes_on_at_its_source_while_its_target_follows_then_leads(
        qwen2_vl_dir: Path, pair: tuple[Side, Side], temperature: float) -> None:
    """Make-before-break (worker/engine/token_feed.py): the source hands the decode over
    with its KV as of now and keeps decoding; the target pulls that KV and is fed the
    tokens the source sampled since (their KV computed, nothing sampled, nothing emitted);
    after the cut-over (the lead) it samples from there on exactly the tokens of an
    uninterrupted run."""
    src, dst = pair
    proc, case, params, whole = _uninterrupted(qwen2_vl_dir, temperature)

    req = to_request(proc, case, "x", params, stages=PD)
    req.moves_live = True
    src.engine.add_request(req)
    _run_until(src.engine, req, 6)
    src.engine.offload(migrate=True)
    outs = src.engine.step()
    (out,) = [o for o in outs if o.handoff is not None]
    assert not out.finished and out.handoff.held is not None and req.handed_over_live
    assert src.engine.live_handovers() == {"x"} and src.engine.parked_ids() == []
    kv = _wire(src.service.offer_precopy("x", out.handoff.held))
    assert kv.generated + [kv.first_token] == req.output_token_ids

    _run_until(src.engine, req, 12)  # the source goes on (the client gets these from it)
    assert req.output_token_ids == whole.output_token_ids[:12] and src.engine.parked_ids() == []
    block_ids = await dst.service.pull_kv(kv, [*req.prompt_token_ids, *kv.generated], req.mm_items)
    cont = to_request(proc, case, "x", params, stages={Stage.DECODE},
                      prefilled=PrefilledKV(block_ids, kv.num_tokens, kv.first_token, generated=kv.generated))
    cont.images, cont.feed = {}, TokenFeed()
    start = len(kv.generated) + 1
    cont.feed.put(start, req.output_token_ids[start:12])
    cont.feed.put(start, req.output_token_ids[start:start + 2])  # a repeat changes nothing
    dst.engine.add_request(cont)
    emitted: list[int] = []
    for _ in range(3):  # following: the fed tokens' KV computed in one chunk, nothing sampled
        emitted += [t for o in dst.engine.step() if o.request_id == "x" for t in o.new_token_ids]
    assert emitted == [] and cont.output_token_ids == whole.output_token_ids[:12]
    assert cont.num_computed_tokens == cont.num_tokens - 1 and dst.engine.scheduler.counters.steps == 1
    cont.feed.put(12, [], lead=True)  # the cut-over: the source stopped at 12 tokens
    while not cont.is_finished:
        emitted += [t for o in dst.engine.step() if o.request_id == "x" for t in o.new_token_ids]
    assert cont.output_token_ids == whole.output_token_ids and cont.finish_reason == FinishReason.LENGTH
    assert emitted == whole.output_token_ids[12:]  # none of the fed tokens (nor the earlier ones) again
    assert dst.engine.scheduler.counters.steps == 1 + 12 and cont.feed.mismatches == 0

    src.engine.abort("x")  # the router closed the source's stream
    src.engine.step()
    assert await eventually(lambda: src.service.leases.outstanding() == 0, timeout_s=10.0)  # pulled, confirmed
    src.engine.step()
    assert src.engine.kv.num_used == 0 and dst.engine.kv.num_used == 0
    assert src.engine.request_ids() == [] and dst.engine.request_ids() == []


def test_a_token_feed_gives_the_tokens_that_extend_the_decode_in_order() -> None:
    feed = TokenFeed()
    feed.put(5, [50, 51])
    feed.put(8, [80])  # ahead of a gap: waits for index 7
    assert feed.take([0, 1, 2, 3]) == []  # index 4 not fed yet
    assert feed.take([0, 1, 2, 3, 4]) == [50, 51]
    feed.put(6, [61, 70])  # 6 is had already (and differs: counted), 7 fills the gap
    assert feed.take([0, 1, 2, 3, 4, 50, 51]) == [70, 80] and feed.mismatches == 1
    assert feed.following(9)  # no cut yet
    feed.put(9, [90], lead=True)  # the last token the source streamed, and the cut
    assert feed.lead_at == 10 and feed.following(9) and not feed.following(10)


def test_a_feed_reaches_only_a_live_takeover_and_is_recorded_in_its_moments() -> None:
    """`POST /internal/feed`'s handler (worker/takeover.feed): tokens for a live takeover here
    go to its feed; its `recent_takeovers` record counts them and the calls, and the lead says
    from which output index the stream is this instance's."""
    moments = {"request_id": "r.t1", "fed_tokens": 0, "feeds": 0, "led_at": None, "lead_index": None,
               "lead_batch": None}
    inst = SimpleNamespace(feeds={"r.t1": TokenFeed()}, takeovers=[moments], engine=None)
    assert not takeover.feed(inst, FeedRequest(request_id="other", start=5, token_ids=[1]))
    assert takeover.feed(inst, FeedRequest(request_id="r.t1", start=5, token_ids=[50, 51]))
    assert moments["lead_batch"] is None  # no lead yet
    assert takeover.feed(inst, FeedRequest(request_id="r.t1", start=7, token_ids=[52], lead=True), batch=3)
    assert inst.feeds["r.t1"].take([0, 1, 2, 3, 4]) == [50, 51, 52] and inst.feeds["r.t1"].lead_at == 8
    assert moments["fed_tokens"] == 3 and moments["feeds"] == 2 and moments["lead_index"] == 8
    assert moments["led_at"] is not None and moments["lead_batch"] == 3  # its call brought 3 feeds
