"""Path planning (HydraInfer §4.4 keep-local rule), policies and cache affinity: pure logic."""

from __future__ import annotations

import dataclasses
import random

import pytest

from triptych.router.affinity import AffinityIndex
from triptych.router.registry import Instance, Registry
from triptych.router.routing import (
    Chooser,
    EncodeRun,
    Hop,
    NoInstanceError,
    Policy,
    parse_stage_policies,
    plan_path,
    plan_request,
    spread_images,
    stages_for,
)
from triptych.topology import InstanceType, Stage, parse_topology


def registry(spec: str) -> Registry:
    urls, roles = [], []
    for kind, n in parse_topology(spec).items():
        for i in range(n):
            urls.append(f"http://{kind.value.lower()}{i}")
            roles.append(kind)
    reg = Registry(urls)
    for url, role in zip(urls, roles, strict=True):
        inst = reg.instances[url]
        inst.role, inst.ready = role, True
    return reg


def path(spec: str, images: bool = True) -> list[tuple[str, list[str]]]:
    hops = plan_path(registry(spec), Chooser(), stages_for(images))
    return [(h.instance.url.removeprefix("http://"), [s.value for s in h.stages]) for h in hops]


@pytest.mark.parametrize(("spec", "expected"), [
    ("EPD", [("epd0", ["encode", "prefill", "decode"])]),
    ("1E1P1D", [("e0", ["encode"]), ("p0", ["prefill"]), ("d0", ["decode"])]),
    ("1EP1D", [("ep0", ["encode", "prefill"]), ("d0", ["decode"])]),
    ("1ED1P", [("ed0", ["encode"]), ("p0", ["prefill"]), ("ed0", ["decode"])]),
    ("1E1PD", [("e0", ["encode"]), ("pd0", ["prefill", "decode"])]),
])
def test_keep_local_rule(spec, expected):
    assert path(spec) == expected


def test_text_requests_skip_encode():
    assert path("1E1P1D", images=False) == [("p0", ["prefill"]), ("d0", ["decode"])]


def test_no_instance_for_a_stage():
    reg = registry("1E1P1D")
    reg.instances["http://d0"].ready = False
    with pytest.raises(NoInstanceError) as err:
        plan_path(reg, Chooser(), stages_for(True))
    assert err.value.stage is Stage.DECODE


def test_round_robin_and_exclusion():
    reg = registry("1E3P1D")
    chooser = Chooser()
    picks = [chooser.choose(Stage.PREFILL, reg.capable(Stage.PREFILL)).url for _ in range(6)]
    assert picks == ["http://p0", "http://p1", "http://p2"] * 2
    hops = plan_path(reg, chooser, stages_for(False), exclude={"http://p0", "http://p1"})
    assert hops[0].instance.url == "http://p2"


def test_least_loaded_and_power_of_two():
    reg = registry("3P1D")
    for url, load in (("http://p0", 5.0), ("http://p1", 1.0), ("http://p2", 3.0)):
        reg.instances[url].load = load
    least = Chooser(Policy.LEAST_LOADED)
    assert {least.choose(Stage.PREFILL, reg.capable(Stage.PREFILL)).url for _ in range(5)} == {"http://p1"}
    p2c = Chooser(Policy.POWER_OF_TWO, rng=random.Random(0))
    picks = [p2c.choose(Stage.PREFILL, reg.capable(Stage.PREFILL)).url for _ in range(200)]
    assert "http://p0" not in picks  # the most loaded never wins a pair
    assert {"http://p1", "http://p2"} == set(picks)


def test_stage_policies_override_the_default():
    chooser = Chooser(Policy.ROUND_ROBIN, parse_stage_policies(["decode=least-loaded"]))
    assert chooser.policy_for(Stage.DECODE) is Policy.LEAST_LOADED
    assert chooser.policy_for(Stage.ENCODE) is Policy.ROUND_ROBIN
    with pytest.raises(ValueError, match="STAGE=POLICY"):
        parse_stage_policies(["decode"])
    with pytest.raises(ValueError):
        parse_stage_policies(["render=round-robin"])


def test_parallel_encode_spreads_images_over_encoders():
    reg = registry("2E1P1D")
    chooser = Chooser()
    first = plan_path(reg, chooser, stages_for(True))[0].instance
    picks = spread_images(reg, chooser, 3, first)
    assert picks[0] is first and {p.url for p in picks} == {"http://e0", "http://e1"}


def test_affinity_index_points_to_live_encoders_only():
    reg = registry("2E1P1D")
    index = AffinityIndex(capacity=2)
    index.remember("h1", "http://e1")
    assert index.holder("h1", reg, set()).url == "http://e1"
    assert index.holder("h1", reg, {"http://e1"}) is None
    reg.instances["http://e1"].ready = False
    assert index.holder("h1", reg, set()) is None
    index.remember("h2", "http://e0")
    index.remember("h3", "http://e0")  # capacity 2: h1 is forgotten
    reg.instances["http://e1"].ready = True
    assert index.holder("h1", reg, set()) is None


def test_instance_role_gates_stages():
    inst = Instance("http://x", role=InstanceType.ED, ready=True)
    assert inst.can_run(Stage.ENCODE) and inst.can_run(Stage.DECODE) and not inst.can_run(Stage.PREFILL)
    inst.draining = True
    assert not inst.can_run(Stage.ENCODE)


def test_decode_hop_deadline_grows_with_max_tokens():
    from triptych.router.backend import GenerationRequest
    from triptych.router.orchestrator_config import OrchestratorConfig, hop_deadline
    from triptych.sampling_params import SamplingParams

    config = OrchestratorConfig(stage_timeout_s=10, per_token_timeout_s=0.5)
    req = GenerationRequest("r", [1, 2], [], [], SamplingParams(max_tokens=100))
    assert hop_deadline(config, [Stage.ENCODE], req) == 10
    assert hop_deadline(config, [Stage.PREFILL], req) == 10
    assert hop_deadline(config, [Stage.PREFILL, Stage.DECODE], req) == 60


def test_plan_request_returns_the_final_plan_with_image_placement():
    """E then EP (1E1EP1D): IRP places image a on E (an encode-only run first) and b on EP,
    which prefills, so EP's own hop encodes b; the E-only hop itself is gone."""
    reg = registry("1E1EP1D")
    plan = plan_request(reg, Chooser(), ["a", "b", "a"])
    e0, ep0, d0 = (reg.instances[f"http://{n}"] for n in ("e0", "ep0", "d0"))
    assert plan.encodes == (EncodeRun(e0, ("a",)),)
    assert plan.hops == (Hop(ep0, (Stage.ENCODE, Stage.PREFILL), ("b",)), Hop(d0, (Stage.DECODE,)))
    assert plan.placement == (("a", "http://e0"), ("b", "http://ep0"))
    assert [(d.stage.value, d.outcome) for d in plan.decisions] == [
        ("encode", "chosen"), ("prefill", "chosen"), ("decode", "chosen")]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.hops[0].images = ()  # type: ignore[misc]


def test_plan_request_without_parallel_encoding_and_for_text():
    reg = registry("2E1P1D")
    plan = plan_request(reg, Chooser(), ["a", "b"], parallel_encode=False)
    assert [(r.instance.url, r.images) for r in plan.encodes] == [("http://e0", ("a", "b"))]
    assert [(h.instance.url, h.stages, h.images) for h in plan.hops] == [
        ("http://p0", (Stage.PREFILL,), ()), ("http://d0", (Stage.DECODE,), ())]
    text = plan_request(reg, Chooser(), [])
    assert text.encodes == () and text.placement == () and [h.instance.url for h in text.hops] == [
        "http://p0", "http://d0"]


def test_plan_request_places_images_by_affinity_first():
    reg = registry("2E1P1D")
    index = AffinityIndex(capacity=8)
    index.remember("a", "http://e1")
    plan = plan_request(reg, Chooser(), ["a", "b"], affinity=index)  # IRP alone: a -> e0, b -> e1
    assert [(r.instance.url, r.images) for r in plan.encodes] == [("http://e1", ("a", "b"))]
    assert [(d.stage, d.policy, d.outcome) for d in plan.decisions if d.outcome == "affinity"] == [
        (Stage.ENCODE, "cache-affinity", "affinity")]
    assert plan.cached == ("a",)  # placed where it is likely cached (a video there is not decoded)
    assert plan_request(reg, Chooser(), ["a", "b"]).cached == ()  # no affinity: nothing known cached
    # The holder may be the instance that prefills: it then encodes in its own hop.
    reg = registry("1E1EP1D")
    index.remember("a", "http://ep0")
    plan = plan_request(reg, Chooser(), ["a"], affinity=index)
    assert plan.encodes == () and plan.hops[0].stages == (Stage.ENCODE, Stage.PREFILL)
    assert plan.hops[0].images == ("a",)


async def test_a_probe_answered_across_a_switch_does_not_restore_the_old_role() -> None:
    """A /health answer sent before a switch began (role D, ok) that arrives after the
    router marked the instance switching must not put it back in rotation as a D."""
    import asyncio

    import httpx

    answer_now = asyncio.Event()

    async def health(request: httpx.Request) -> httpx.Response:
        await answer_now.wait()
        return httpx.Response(200, json={"role": "D", "status": "ok", "instance_id": "D-0", "load": 0})

    registry = Registry(urls=["http://d0"])
    inst = registry.instances["http://d0"]
    async with httpx.AsyncClient(transport=httpx.MockTransport(health)) as client:
        probe = asyncio.create_task(registry.refresh(client))
        await asyncio.sleep(0.05)  # the probe is waiting for its answer
        registry.mark_switching("http://d0", "P")
        answer_now.set()
        await probe
        assert not inst.ready and inst.switching_to == "P" and not inst.can_run(Stage.DECODE)
        await registry.refresh(client)  # a probe sent after the mark is believed
        assert inst.ready and inst.role == InstanceType.D
