"""A switch to E while the language model still has work (role_change.drops_language_later,
worker/live_switch.py): the vision tower joins the parts held (`Engine.join_parts`), the
instance answers and encodes at once, the old role's decodes go on to their exact tokens
until they move out, and only then are the language model and its KV cache freed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from engine_cases import make_cases, processor, to_request

from triptych.sampling_params import SamplingParams
from triptych.topology import InstanceType, Stage
from triptych.worker.engine import Engine, EngineConfig, RequestStatus
from triptych.worker.engine.request import StageNotServedError
from triptych.worker.engine.role_change import drops_language_later, preload_parts
from triptych.worker.instance import InstanceRuntime
from triptych.worker.settings import WorkerSettings
from triptych.worker.waits import wait_for


def _engine(model_dir: Path, role: InstanceType) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), role=role, num_kv_blocks=96, num_mm_blocks=64, mm_block_rows=8,
                               keep_mm_cache=True))


def _text_request(proc, rid: str, max_tokens: int):
    case = next(c for c in make_cases(8) if not c.images)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return to_request(proc, case, rid, params, stages={Stage.PREFILL, Stage.DECODE})


def _encode_request(proc, rid: str):
    case = next(c for c in make_cases(8) if c.images)
    return to_request(proc, case, rid, SamplingParams(temperature=0.0, max_tokens=1), stages={Stage.ENCODE})


def test_which_switches_drop_the_language_model_later(qwen2_vl_dir: Path) -> None:
    d, e = _engine(qwen2_vl_dir, InstanceType.D), _engine(qwen2_vl_dir, InstanceType.E)
    assert drops_language_later(d, InstanceType.E)
    assert not drops_language_later(d, InstanceType.P)  # keeps the language model
    assert not drops_language_later(e, InstanceType.D)  # E has no language model to keep working
    bare = Engine(EngineConfig(model=str(qwen2_vl_dir), role=InstanceType.D, num_kv_blocks=32))
    assert bare.mm is None and not drops_language_later(bare, InstanceType.E)  # E would need a new MM cache


def test_join_parts_encodes_beside_a_running_decode_exactly(qwen2_vl_dir: Path) -> None:
    """PD -> E with a decode running: the vision tower joins, admission refuses new decodes,
    an encode runs beside the decode and gives the embedding a plain E engine gives, the
    decode reaches the tokens of an uninterrupted run; with its work gone, set_role frees
    the language model and the KV cache and keeps the encode's parked embedding."""
    proc = processor(qwen2_vl_dir)
    (whole,) = _engine(qwen2_vl_dir, InstanceType.PD).generate_batch([_text_request(proc, "w", 12)])
    (plain,) = (e0 := _engine(qwen2_vl_dir, InstanceType.E)).generate_batch([_encode_request(proc, "img")])
    want = {h: e0.mm.tensor[ids].clone() for h, ids, _rows in plain.handoff.mm}

    e = _engine(qwen2_vl_dir, InstanceType.PD)
    req = _text_request(proc, "x", 12)
    e.add_request(req)
    while len(req.output_token_ids) < 3:
        e.step()
    assert e.model.vision is None
    e.join_parts(InstanceType.E, preload_parts(e, InstanceType.E))
    assert e.role == InstanceType.E and e.model.vision is not None and e.model.language is not None
    with pytest.raises(StageNotServedError):
        e.add_request(_text_request(proc, "y", 4))
    enc = _encode_request(proc, "img")
    e.add_request(enc)
    while req.status != RequestStatus.FINISHED:
        e.step()
    assert enc.status == RequestStatus.PARKED
    for h, ids, _rows in enc.handoff.mm:
        torch.testing.assert_close(e.mm.tensor[ids], want[h], rtol=0, atol=0)
    assert req.output_token_ids == whole.output_token_ids
    changed = e.set_role(InstanceType.E)
    assert sorted(changed.freed) == ["kv_cache", "language"] and changed.loaded == []
    assert e.kv is None and e.model.language is None and e.parked_ids(Stage.ENCODE) == ["img"]
    e.release("img")
    e.step()
    assert e.request_ids() == [] and e.mm.num_referenced == 0


async def _decoding_instance(model_dir: Path, **settings: object) -> InstanceRuntime:
    inst = InstanceRuntime(WorkerSettings(model=str(model_dir), instance_id="dl", num_kv_blocks=96,
                                          num_mm_blocks=64, **settings))
    await inst.switch("PD")
    return inst


async def _stream(engine: Engine, req, outs: list, release: asyncio.Event) -> None:
    """A stage run's stand-in: reads the decode's outputs; once it is parked for a hand-over,
    waits for `release` (its next instance's pull) and lets the source free it."""
    async for out in engine.generate(req, timeout_s=60):
        outs.append(out)
        if out.handoff is not None:
            await release.wait()
            engine.release(req.request_id)


async def test_a_switch_to_e_answers_while_its_decode_still_runs_then_frees_the_language_model(
        qwen2_vl_dir: Path) -> None:
    proc = processor(qwen2_vl_dir)
    inst = await _decoding_instance(qwen2_vl_dir, precopy_timeout_s=0, live_handover=False)
    agents = []
    new_agent = inst._new_agent
    inst._new_agent = lambda role: agents.append(new_agent(role)) or agents[-1]  # type: ignore[method-assign]
    try:
        engine, old_agent = inst.engine, inst.transfer
        assert engine is not None
        req, outs, release = _text_request(proc, "long", 120), [], asyncio.Event()
        stream = asyncio.create_task(_stream(engine, req, outs, release))
        assert await wait_for(lambda: len(req.output_token_ids) >= 3, 30)
        report = await inst.switch("E")
        # Answered with the vision tower in and the decode still held: nothing freed yet.
        assert report["migrating"] == 1 and report["migrate_s"] == 0.0 and report["preload_s"] > 0
        assert agents == [] and inst.transfer is old_agent and "kv" in old_agent._regions
        assert inst.role == "E" and inst.engine is engine and engine.role == InstanceType.E
        assert engine.model.vision is not None and engine.model.language is not None
        assert inst.moving_out is not None and not inst.moving_out.done()
        enc_outs = [o async for o in engine.generate(_encode_request(proc, "img"), timeout_s=30)]
        assert enc_outs[-1].handoff is not None and enc_outs[-1].handoff.stage == Stage.ENCODE  # E serves now
        assert await wait_for(lambda: any(o.handoff is not None for o in outs), 30)  # the decode moved out
        assert engine.model.language is not None  # its hand-over is not pulled yet
        release.set()
        await asyncio.wait_for(inst.moving_out, 30)
        await stream
        assert engine.model.language is None and engine.kv is None and engine.mm is not None
        # Its hand-over was pulled before the language model went: no lease is left on the
        # KV cache, so the agent lets that region go and stays (no new one is built).
        assert agents == [] and inst.transfer is old_agent and sorted(old_agent._regions) == ["mm"]
        assert inst.status == "ok"
        last = inst.last_switch
        assert last["migrated_ids"] == ["long"] and last["parts_freed_s"] >= last["handover_s"] > report["total_s"]
        assert engine.parked_ids(Stage.ENCODE) == ["img"]
        engine.release("img")
        assert await wait_for(lambda: engine.request_ids() == [] and inst.leases_outstanding() == 0, 10)
    finally:
        inst.teardown()


async def test_an_idle_switch_to_e_frees_the_language_model_before_it_answers(qwen2_vl_dir: Path) -> None:
    inst = await _decoding_instance(qwen2_vl_dir)
    try:
        report = await inst.switch("E")
        assert "migrating" not in report and inst.moving_out is None
        assert inst.engine is not None and inst.engine.model.language is None and inst.engine.kv is None
    finally:
        inst.teardown()


async def test_the_drop_says_switching_and_waits_for_the_runs_under_way(
        qwen2_vl_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the language model goes, the instance says `switching` (the router sends new
    runs elsewhere) and the drop waits for a stage run still under way."""
    from triptych.worker import live_switch

    proc = processor(qwen2_vl_dir)
    inst = await _decoding_instance(qwen2_vl_dir, precopy_timeout_s=0, live_handover=False)
    seen: list[str] = []
    onload = inst._onload

    async def recording_onload(*args: object) -> None:
        seen.append(inst.status)
        assert inst.inflight == 0
        await onload(*args)

    monkeypatch.setattr(inst, "_onload", recording_onload)
    try:
        engine = inst.engine
        assert engine is not None
        req, outs, release = _text_request(proc, "long", 120), [], asyncio.Event()
        release.set()
        stream = asyncio.create_task(_stream(engine, req, outs, release))
        assert await wait_for(lambda: len(req.output_token_ids) >= 3, 30)
        inst.inflight += 1  # a run under way (an encode stream not yet ended)
        await inst.switch("E")
        assert await wait_for(lambda: inst.status == "switching", 30)
        assert not live_switch.language_work(engine)
        inst.inflight -= 1
        await asyncio.wait_for(inst.moving_out, 30)
        await stream
        assert seen == ["switching"] and inst.status == "ok" and engine.model.language is None
    finally:
        inst.teardown()


async def test_p_to_e_lets_a_prefill_in_flight_finish_exactly_then_frees_the_language_model(
        qwen2_vl_dir: Path) -> None:
    """P -> E with a prompt still prefilling in chunks (a token budget of 1): the switch
    answers at once, the prefill goes on under E to the first token an uninterrupted run
    samples and parks its KV hand-over; then the language model and the KV cache go."""
    proc = processor(qwen2_vl_dir)
    reference = _engine(qwen2_vl_dir, InstanceType.PD)
    (whole,) = reference.generate_batch([_text_request(proc, "w", 2)])
    inst = InstanceRuntime(WorkerSettings(model=str(qwen2_vl_dir), instance_id="pe", num_kv_blocks=96,
                                          num_mm_blocks=64, token_budget=1))
    await inst.switch("P")
    try:
        engine = inst.engine
        assert engine is not None
        req = _text_request(proc, "pre", 2)
        req.stages = {Stage.PREFILL}
        assert req.num_prompt_tokens > 12  # a step per token
        outs: list = []

        async def stream() -> None:
            async for out in engine.generate(req, timeout_s=60):
                outs.append(out)

        task = asyncio.create_task(stream())
        assert await wait_for(lambda: req.num_computed_tokens >= 1, 30)
        report = await inst.switch("E")
        assert "migrating" in report, "the prefill ended before the switch: not the live path"
        assert report["migrating"] == 0 and inst.role == "E"
        await asyncio.wait_for(inst.moving_out, 30)
        await asyncio.wait_for(task, 30)
        handoff = next(o.handoff for o in outs if o.handoff is not None)
        assert handoff.stage == Stage.PREFILL and handoff.first_token == whole.output_token_ids[0]
        assert engine.model.language is None and engine.kv is None and "parts_freed_s" in inst.last_switch
    finally:
        inst.teardown()


async def test_a_drained_switch_with_a_decode_to_move_builds_the_agent_that_takes_over(qwen2_vl_dir: Path) -> None:
    """Without the live path, a switch to E that finds a decode running builds a new agent
    in its preload (the engine still PD): the decode's hand-over is read from the KV cache
    under lease, and the old agent retires with it."""
    proc = processor(qwen2_vl_dir)
    inst = await _decoding_instance(qwen2_vl_dir, precopy_timeout_s=0, live_handover=False, live_switch=False)
    agents: list[tuple[object, str]] = []
    new_agent = inst._new_agent
    inst._new_agent = lambda role: agents.append((new_agent(role), inst.engine.role.value)) or agents[-1][0]  # type: ignore[method-assign]
    try:
        engine, old_agent = inst.engine, inst.transfer
        assert engine is not None and old_agent is not None
        req, outs, release = _text_request(proc, "long", 120), [], asyncio.Event()
        release.set()  # its next instance pulls at once
        stream = asyncio.create_task(_stream(engine, req, outs, release))
        assert await wait_for(lambda: len(req.output_token_ids) >= 3, 30)
        report = await inst.switch("E")
        await stream
        assert report["migrated"] == 1 and [role for _, role in agents] == ["PD"]
        assert inst.transfer is agents[0][0] and sorted(inst.transfer._regions) == ["mm"]
        assert engine.kv is None and inst.role == "E"
        assert await wait_for(lambda: inst.leases_outstanding() == 0 and not inst._retired, 10)
    finally:
        inst.teardown()
