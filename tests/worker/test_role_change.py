"""In-place role changes and decode migration at the engine level (EPDServe §3.2.4):
a decode parked mid-stream and continued on another engine gives exactly the tokens of
an uninterrupted run (greedy and seeded sampling, multimodal prompts), and set_role keeps
what the new role shares (weights, the KV cache) and loads or frees only the rest."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from engine_cases import make_cases, processor, to_request

from triptych.sampling_params import SamplingParams
from triptych.topology import InstanceType, Stage
from triptych.worker.engine import Engine, EngineConfig, PrefilledKV, RequestStatus
from triptych.worker.engine.request import HANDED_BACK, FinishReason, StageNotServedError


def _engine(model_dir: Path, role: InstanceType) -> Engine:
    return Engine(
        EngineConfig(
            model=str(model_dir),
            role=role,
            shuffle_seed=5,
            num_kv_blocks=96,
            num_mm_blocks=64,
            mm_block_rows=8,
        )
    )


def _steps_until(engine: Engine, req, num_outputs: int) -> None:
    engine.add_request(req)
    while len(req.output_token_ids) < num_outputs:
        engine.step()


def _stepped_pd_engine(model_dir: Path):
    """A PD engine this test steps itself (no step thread), and a maker of greedy text
    requests of 64 tokens (ignore_eos) that prefill and decode, by id."""
    proc = processor(model_dir)
    case = next(c for c in make_cases(8) if not c.images)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    e = _engine(model_dir, InstanceType.PD)
    e.driver.start = lambda: None  # type: ignore[method-assign]  # no step thread: the test steps

    def make(request_id: str, stages: frozenset[Stage] = frozenset({Stage.PREFILL, Stage.DECODE})):
        return to_request(proc, case, request_id, params, stages=set(stages))
    return e, make


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_decode_migrated_mid_stream_continues_exactly(qwen2_vl_dir: Path, temperature: float) -> None:
    proc = processor(qwen2_vl_dir)
    case = make_cases(4)[1]  # one image
    params = SamplingParams(temperature=temperature, seed=77, max_tokens=12, ignore_eos=True)
    src, dst = _engine(qwen2_vl_dir, InstanceType.EPD), _engine(qwen2_vl_dir, InstanceType.PD)
    (whole,) = _engine(qwen2_vl_dir, InstanceType.EPD).generate_batch([to_request(proc, case, "w", params)])

    req = to_request(proc, case, "x", params)
    _steps_until(src, req, 5)
    src.offload(migrate=True)
    outs = src.step()
    assert req.status == RequestStatus.PARKED
    handoff = next(o.handoff for o in outs if o.handoff is not None)
    assert handoff.stage == Stage.DECODE and handoff.generated + [handoff.first_token] == req.output_token_ids
    assert handoff.num_kv_tokens == req.num_prompt_tokens + len(handoff.generated)
    assert src.stats()["counters"]["migrated_out"] == 1

    ids = dst.reserve_kv(handoff.num_kv_tokens)
    dst.kv.tensor[torch.tensor(ids)] = src.kv.tensor[torch.tensor(handoff.kv_block_ids)]
    cont = to_request(
        proc,
        case,
        "x",
        params,
        stages={Stage.DECODE},
        prefilled=PrefilledKV(
            ids, handoff.num_kv_tokens, handoff.first_token, generated=list(handoff.generated)
        ),
    )
    cont.images = {}
    dst.generate_batch([cont])
    src.release("x")
    src.step()
    assert cont.output_token_ids == whole.output_token_ids
    assert cont.finish_reason == FinishReason.LENGTH and len(cont.output_token_ids) == 12
    assert src.kv.num_used == 0 and dst.kv.num_used == 0
    assert dst.stats()["counters"]["prefill_tokens"] == 0


def test_offload_hands_back_queued_requests_only(qwen2_vl_dir: Path) -> None:
    proc = processor(qwen2_vl_dir)
    cases = make_cases(3)
    e = _engine(qwen2_vl_dir, InstanceType.EPD)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    started = to_request(proc, cases[0], "a", params)
    e.add_request(started)
    e.step()  # admitted and (partly) prefilled
    queued = to_request(proc, cases[2], "b", params)
    e.add_request(queued)
    e.offload(migrate=False)
    outs = e.step()
    back = [o for o in outs if o.request_id == "b"]
    assert back and back[-1].finished and back[-1].error == HANDED_BACK
    assert started.status != RequestStatus.FINISHED
    assert e.stats()["counters"]["handed_back"] == 1


def test_p_to_d_keeps_weights_and_kv_cache(qwen2_vl_dir: Path) -> None:
    e = _engine(qwen2_vl_dir, InstanceType.P)
    language, kv = e.language, e.kv
    changed = e.set_role(InstanceType.D)
    assert e.role == InstanceType.D and e.language is language and e.kv is kv
    assert changed.loaded == [] and changed.freed == []
    e.set_role(InstanceType.P)
    assert e.language is language and e.kv is kv and e.mm is not None


def test_e_to_d_loads_the_language_model_and_frees_the_vision_tower(qwen2_vl_dir: Path) -> None:
    proc = processor(qwen2_vl_dir)
    e = _engine(qwen2_vl_dir, InstanceType.E)
    changed = e.set_role(InstanceType.PD)
    assert changed.loaded == ["language", "kv_cache"] and changed.freed == ["vision"]
    assert e.vision is None and e.language is not None and e.kv is not None
    text_only = next(
        to_request(
            proc, c, "t", SamplingParams(temperature=0.0, max_tokens=3), stages={Stage.PREFILL, Stage.DECODE}
        )
        for c in make_cases(8)
        if not c.images
    )
    (out,) = e.generate_batch([text_only])
    assert len(out.output_token_ids) == 3
    changed = e.set_role(InstanceType.E)
    assert changed.loaded == ["vision"] and changed.freed == ["language", "kv_cache"] and e.kv is None


def test_set_role_refuses_an_engine_with_requests(qwen2_vl_dir: Path) -> None:
    proc = processor(qwen2_vl_dir)
    e = _engine(qwen2_vl_dir, InstanceType.PD)
    e.add_request(
        next(
            to_request(
                proc,
                c,
                "t",
                SamplingParams(temperature=0.0, max_tokens=3),
                stages={Stage.PREFILL, Stage.DECODE},
            )
            for c in make_cases(8)
            if not c.images
        )
    )
    with pytest.raises(RuntimeError, match="idle engine"):  # E drops the language model it runs on
        e.set_role(InstanceType.E)


def test_a_live_switch_keeps_stepping_the_old_roles_decode_exactly(qwen2_vl_dir: Path) -> None:
    """PD -> P with a decode running (the parts stay: `same_parts`): the role changes at
    once, admission refuses new decodes, the running one goes on to the exact tokens of an
    uninterrupted run and, parked at a step boundary (`park_decodes`), hands over
    `generated` + `first_token` = its tokens so far; released, it frees its blocks."""
    proc = processor(qwen2_vl_dir)
    case = next(c for c in make_cases(8) if not c.images)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    (whole,) = _engine(qwen2_vl_dir, InstanceType.PD).generate_batch(
        [to_request(proc, case, "w", params, stages={Stage.PREFILL, Stage.DECODE})])
    e = _engine(qwen2_vl_dir, InstanceType.PD)
    req = to_request(proc, case, "x", params, stages={Stage.PREFILL, Stage.DECODE})
    _steps_until(e, req, 3)
    changed = e.set_role(InstanceType.P)
    assert changed.loaded == [] and changed.freed == [] and e.role == InstanceType.P
    with pytest.raises(StageNotServedError):
        e.add_request(to_request(proc, case, "y", params, stages={Stage.PREFILL, Stage.DECODE}))
    while len(req.output_token_ids) < 7:
        e.step()
    e.park_decodes()
    outs = e.step()
    handoff = next(o.handoff for o in outs if o.handoff is not None)
    assert req.status == RequestStatus.PARKED
    # The tokens its stream had when it moved: the next one is its new instance's first.
    assert e.output.moved_out == {"x": len(req.output_token_ids)} and len(req.output_token_ids) >= 7
    assert handoff.generated + [handoff.first_token] == whole.output_token_ids[:len(req.output_token_ids)]
    e.release("x")
    e.step()
    assert e.request_ids() == [] and e.kv.num_used == 0


def test_a_switchable_d_to_p_allocates_nothing(qwen2_vl_dir: Path) -> None:
    e = Engine(EngineConfig(model=str(qwen2_vl_dir), role=InstanceType.D, num_kv_blocks=32, num_mm_blocks=16,
                            mm_block_rows=8, keep_mm_cache=True))
    kv, mm = e.kv, e.mm
    assert mm is not None
    changed = e.set_role(InstanceType.P)
    assert changed.loaded == [] and changed.freed == [] and e.kv is kv and e.mm is mm


def test_a_parked_decode_stays_in_its_blocks_across_d_to_p_until_released(qwen2_vl_dir: Path) -> None:
    """A D -> P switch need not wait for its migrated decodes' pulls: the parked decode keeps
    its KV blocks (held under its lease) in the kept KV cache, the new P serves meanwhile,
    and the release frees them (a change that drops the KV cache detaches it instead:
    test_precopy.py)."""
    proc = processor(qwen2_vl_dir)
    case = next(c for c in make_cases(8) if not c.images)
    e = _engine(qwen2_vl_dir, InstanceType.PD)
    req = to_request(proc, case, "m", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                     stages={Stage.PREFILL, Stage.DECODE})
    _steps_until(e, req, 4)
    e.offload(migrate=True)
    e.step()
    assert req.status == RequestStatus.PARKED and e.parked_ids(Stage.DECODE) == ["m"]
    held = e.kv.num_used
    assert held > 0 and e.request_ids(parked=False) == []
    e.set_role(InstanceType.P)
    assert e.role == InstanceType.P and e.parked_ids() == ["m"] and e.kv.num_used == held
    other = to_request(proc, case, "p", SamplingParams(temperature=0.0, max_tokens=4), stages={Stage.PREFILL})
    (out,) = e.generate_batch([other])  # the new role serves while the hand-over is pending
    assert out.handoff is not None and out.handoff.stage == Stage.PREFILL and len(out.output_token_ids) == 1
    assert e.parked_ids() == ["m", "p"] and e.parked_ids(Stage.DECODE) == ["m"]
    e.release("m")
    e.release("p")
    e.step()
    assert e.parked_ids() == [] and e.request_ids() == [] and e.kv.num_used == 0


def test_a_parked_embedding_stays_across_e_to_pd_until_released(qwen2_vl_dir: Path) -> None:
    """E -> P/D keeps the MM cache, so an encode's hand-over (its embedding, held under a
    lease) need not be pulled before the switch ends: it stays in the same blocks while the
    new role serves, and its release frees them. E -> nothing-with-an-MM-cache would not."""
    from triptych.worker.engine.role_change import keeps_handovers

    proc = processor(qwen2_vl_dir)
    case = next(c for c in make_cases(8) if c.images)
    e = _engine(qwen2_vl_dir, InstanceType.E)
    (er,) = e.generate_batch([to_request(proc, case, "x", SamplingParams(temperature=0.0, max_tokens=1),
                                         stages={Stage.ENCODE})])
    assert er.status == RequestStatus.PARKED and e.parked_ids(Stage.ENCODE) == ["x"]
    held = e.mm.num_referenced
    assert held > 0
    assert keeps_handovers(e, InstanceType.PD) and keeps_handovers(e, InstanceType.P)
    mm = e.mm
    e.set_role(InstanceType.PD)
    assert e.mm is mm and e.parked_ids() == ["x"] and e.mm.num_referenced == held
    text = next(c for c in make_cases(8) if not c.images)
    (out,) = e.generate_batch([to_request(proc, text, "t", SamplingParams(temperature=0.0, max_tokens=3),
                                          stages={Stage.PREFILL, Stage.DECODE})])
    assert len(out.output_token_ids) == 3  # the new role serves while the hand-over is pending
    e.release("x")
    e.step()
    assert e.parked_ids() == [] and e.request_ids() == [] and e.mm.num_referenced == 0


def test_a_stage_the_role_no_longer_runs_is_the_instances_503_not_the_clients_400(qwen2_vl_dir: Path) -> None:
    """A decode run admitted by the server just before a D -> P switch reaches the engine
    after it: the engine's refusal must be a retriable 503 (the router tries another D),
    not a 400 the client would see; a malformed request stays a 400."""
    from triptych.worker.engine.request import RequestValidationError
    from triptych.worker.errors import http_status

    proc = processor(qwen2_vl_dir)
    case = next(c for c in make_cases(8) if not c.images)
    e = _engine(qwen2_vl_dir, InstanceType.P)
    with pytest.raises(RequestValidationError) as info:
        e.add_request(to_request(proc, case, "d", SamplingParams(temperature=0.0, max_tokens=2),
                                 stages={Stage.PREFILL, Stage.DECODE}))
    assert "does not run stage(s) decode" in str(info.value) and http_status(info.value) == 503
    assert http_status(RequestValidationError("token id out of range")) == 400


async def test_a_live_switch_delivers_the_hand_backs_and_pre_copy_offers_it_asks_for(qwen2_vl_dir: Path) -> None:
    """The instance asks for hand-backs and pre-copy offers, then changes the role in place
    (worker/live_switch.py); when set_role runs them from the inbox before the step thread
    does, their outputs still reach the streams: the queued request ends handed back (its
    stream does not hang) and the running decode gets its pre-copy offer (the switch does
    not wait out its pre-copy timeout). The test steps the engine itself, so set_role is
    the one that finds them in the inbox."""
    e, make = _stepped_pd_engine(qwen2_vl_dir)

    async def collect(req, into: list) -> None:
        async for out in e.generate(req, timeout_s=30):
            into.append(out)

    running, queued = make("run"), make("q")
    ran: list = []
    run_task = asyncio.create_task(collect(running, ran))
    while len(running.output_token_ids) < 3:
        await asyncio.sleep(0)
        e.driver.deliver(e.step())
    assert running.num_computed_tokens >= e.kv.block_size  # a full block to pre-copy
    handed: list = []
    queued_task = asyncio.create_task(collect(queued, handed))
    await asyncio.sleep(0)  # its add is in the inbox
    e.offload(migrate=False)
    e.precopy()
    e.set_role(InstanceType.P)
    await asyncio.wait_for(queued_task, 5)  # before the fix: hung until its timeout
    assert handed[-1].finished and handed[-1].error == HANDED_BACK
    for _ in range(100):
        if any(o.precopy for o in ran):
            break
        await asyncio.sleep(0.01)
    assert [o.precopy for o in ran].count(True) == 1 and e.precopies_waiting() == 1
    run_task.cancel()
    await asyncio.gather(run_task, return_exceptions=True)
    e.step()  # the abort of the cancelled stream
    assert e.request_ids() == [] and e.kv.num_used == 0


async def test_a_live_switch_moves_out_a_decode_added_while_the_role_changes(qwen2_vl_dir: Path) -> None:
    """A decode hop's inputs were pulled before the switch (it waits for no `preparing`
    run), but its stream added it to the engine only once the switch was under way —
    validated under the old role. It must move out with the rest and be listed (`migrating`):
    before, it was parked and moved without being counted (a role-switch test saw the other
    D take over 4 decodes of a switch that listed 3). A prefill-only request still in the
    inbox is no leaving decode."""
    from triptych.worker.instance import InstanceRuntime
    from triptych.worker.live_switch import leaving_decodes, switch_live
    from triptych.worker.settings import WorkerSettings

    e, make = _stepped_pd_engine(qwen2_vl_dir)
    running = make("run")
    _steps_until(e, running, 3)
    e.add_request(make("prefill-only", frozenset({Stage.PREFILL})))
    assert leaving_decodes(e, InstanceType.P) == ["run"]  # in the inbox, but no decode
    late = make("late")
    set_role = e.set_role

    def add_then_set_role(role: InstanceType, **kwargs: object) -> object:
        e.add_request(late)  # the stream's add, after the switch's wait and its list of leavers
        return set_role(role, **kwargs)

    e.set_role = add_then_set_role  # type: ignore[method-assign]
    inst = InstanceRuntime(WorkerSettings(model=str(qwen2_vl_dir), instance_id="w-late", precopy_timeout_s=0))
    inst.engine = e
    try:
        report = await switch_live(inst, InstanceType.P, 0.0)
        assert report["migrating"] == 2 and inst.last_switch["handover_pending"] == 2
    finally:
        assert inst.moving_out is not None
        inst.moving_out.cancel()
        await asyncio.gather(inst.moving_out, return_exceptions=True)


def test_set_role_without_waiting_gives_way_to_a_step_holding_the_engine(qwen2_vl_dir: Path) -> None:
    """A live switch changes the role on its event loop unless a step holds the engine's
    lock right then (`wait=False`: None at once, nothing changed); it then waits in a thread."""
    import threading

    e = _engine(qwen2_vl_dir, InstanceType.D)
    held, done = threading.Event(), threading.Event()

    def step_holding_the_lock() -> None:
        with e._lock:
            held.set()
            done.wait(10)

    stepper = threading.Thread(target=step_holding_the_lock)
    stepper.start()
    try:
        assert held.wait(10)
        assert e.set_role(InstanceType.P, wait=False) is None and e.role == InstanceType.D
    finally:
        done.set()
        stepper.join(10)
    assert e.set_role(InstanceType.P, wait=False) is not None and e.role == InstanceType.P


async def test_p_to_d_does_not_wait_for_a_run_pulling_its_inputs_and_lets_it_land(qwen2_vl_dir: Path) -> None:
    """A P -> D switch answers without waiting for a prefill run still pulling its inputs
    (nothing moves out of a role that decodes); until that run is in, admission takes a
    prefill too, then only what D runs. A D -> P switch still waits for such runs (a decode
    among them must be listed to move out)."""
    from triptych.worker.instance import InstanceRuntime
    from triptych.worker.live_switch import switch_live
    from triptych.worker.settings import WorkerSettings

    proc = processor(qwen2_vl_dir)
    case = next(c for c in make_cases(8) if not c.images)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    def runtime(role: InstanceType) -> InstanceRuntime:
        inst = InstanceRuntime(WorkerSettings(model=str(qwen2_vl_dir), instance_id=f"w-{role.value}",
                                              drain_timeout_s=30, precopy_timeout_s=0))
        inst.engine, inst.role, inst.preparing = _engine(qwen2_vl_dir, role), role.value, 1  # a run pulling
        return inst

    p = runtime(InstanceType.P)
    report = await asyncio.wait_for(switch_live(p, InstanceType.D, 0.0), 5)
    assert p.engine.role == InstanceType.D and p.role == "D" and report["migrating"] == 0
    p.engine.add_request(to_request(proc, case, "landed", params, stages={Stage.PREFILL}))  # the run lands
    p.preparing = 0
    await asyncio.wait_for(p.moving_out, 5)
    with pytest.raises(StageNotServedError):
        p.engine.add_request(to_request(proc, case, "late", params, stages={Stage.PREFILL}))

    d = runtime(InstanceType.D)
    switching = asyncio.create_task(switch_live(d, InstanceType.P, 0.0))
    await asyncio.sleep(0.2)
    assert not switching.done() and d.engine.role == InstanceType.D
    d.preparing = 0
    await asyncio.wait_for(switching, 5)
    assert d.engine.role == InstanceType.P
