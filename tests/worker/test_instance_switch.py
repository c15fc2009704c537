"""An instance's in-place switch builds what the new role needs while the old role's work
still moves out: the weights it adds and, when the change drops a cache that hand-overs
may still read, the transfer agent that replaces the old one (role_change.drops_caches);
with nothing left to read there, the agent it has lets that region go. An instance built
without a vision tower has already imported what loading one imports. A failed switch
leaves no agent behind."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

import triptych.worker.instance as instance_module
from triptych.topology import InstanceType
from triptych.worker.engine import Engine, EngineConfig
from triptych.worker.engine.role_change import drops_caches
from triptych.worker.instance import InstanceRuntime
from triptych.worker.models.spec import UnsupportedCheckpointError, read_spec
from triptych.worker.models.vision import warm_imports
from triptych.worker.settings import WorkerSettings
from triptych.worker.transfer import TransferEngine
from triptych.worker.waits import wait_for

# Every change the chain passes through: each part and cache is added and dropped.
CHAIN = ["E", "P", "D", "EP", "E", "D", "EPD", "P", "E", "PD", "ED", "D", "E"]


@pytest.mark.parametrize("keep_mm_cache", [False, True])
def test_drops_caches_says_what_set_role_frees(qwen2_vl_dir: Path, keep_mm_cache: bool) -> None:
    engine = Engine(EngineConfig(model=str(qwen2_vl_dir), role=InstanceType(CHAIN[0]), num_kv_blocks=32,
                                 num_mm_blocks=16, keep_mm_cache=keep_mm_cache))
    seen = set()
    for role in map(InstanceType, CHAIN[1:]):
        predicted = drops_caches(engine, role)
        assert engine.set_role(role).caches_dropped == predicted, (engine.role, role)
        seen.add(predicted)
    assert seen == {True, False}  # the chain tells both kinds apart


def _runtime(model_dir: Path, agents: list[tuple[TransferEngine, str | None]], monkeypatch: pytest.MonkeyPatch,
             warmed: list[str]) -> InstanceRuntime:
    """An instance whose new agents are recorded with the role its engine had when each was made."""
    inst = InstanceRuntime(WorkerSettings(model=str(model_dir), instance_id="sw", num_kv_blocks=32, num_mm_blocks=16))
    new_agent = inst._new_agent

    def recording(role: InstanceType) -> TransferEngine:
        agent = new_agent(role)
        agents.append((agent, None if inst.engine is None else inst.engine.role.value))
        return agent

    monkeypatch.setattr(inst, "_new_agent", recording)
    monkeypatch.setattr(instance_module, "warm_imports", lambda spec, model_dir: warmed.append(spec.family))
    return inst


async def test_an_idle_switch_that_drops_a_cache_keeps_its_agent_and_lets_the_region_go(
        qwen2_vl_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    agents: list[tuple[TransferEngine, str | None]] = []
    warmed: list[str] = []
    inst = _runtime(qwen2_vl_dir, agents, monkeypatch, warmed)
    try:
        await inst.switch("D")
        assert warmed == ["qwen2-vl"]  # built without a vision tower: its imports are warm
        agent = inst.transfer
        assert agent is not None and sorted(agent._regions) == ["kv", "mm"]
        await inst.switch("E")  # drops the KV cache, which no hand-over reads: no new agent
        assert len(agents) == 1 and inst.transfer is agent and inst.engine.role is InstanceType.E
        assert sorted(agent._regions) == ["mm"] and inst.engine.kv is None
        await inst.switch("D")  # E -> D: a new KV cache, registered with the same agent
        assert len(agents) == 1 and inst.transfer is agent
        assert agent._regions["kv"].tensor is inst.engine.kv.tensor
    finally:
        inst.teardown()
    assert warmed == ["qwen2-vl"]


@pytest.mark.parametrize("failing", ["set_role", "migrate"])
async def test_a_switch_that_fails_closes_the_agent_it_built(qwen2_vl_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                              failing: str) -> None:
    agents: list[tuple[TransferEngine, str | None]] = []
    inst = _runtime(qwen2_vl_dir, agents, monkeypatch, [])
    closed: list[TransferEngine] = []
    try:
        await inst.switch("D")
        old = inst.transfer
        engine = inst.engine
        assert engine is not None

        def fail(*_args: object, **_kwargs: object) -> None:
            raise RuntimeError(f"{failing} failed")

        async def fail_async(*_args: object, **_kwargs: object) -> None:
            fail()

        if failing == "set_role":  # in the onload, once the preload ended
            monkeypatch.setattr(engine, "set_role", fail)
        else:  # while the preload may still run: its agent goes when it ends
            monkeypatch.setattr(inst, "_migrate", fail_async)
        monkeypatch.setattr(TransferEngine, "close", lambda self: closed.append(self))
        monkeypatch.setattr(inst, "_needs_new_agent", lambda role: True)  # the preload builds one
        with pytest.raises(RuntimeError, match=f"{failing} failed"):
            await inst.switch("E")
        assert await wait_for(lambda: bool(closed), 30.0)
        assert closed == [agents[-1][0]] and inst.transfer is old and inst.role == "D"
    finally:
        monkeypatch.undo()
        inst.teardown()


@pytest.mark.parametrize("checkpoint", ["qwen2_vl_dir", "llava_dir"])
def test_warm_imports_runs_for_each_family(request: pytest.FixtureRequest, checkpoint: str) -> None:
    model_dir: Path = request.getfixturevalue(checkpoint)
    spec = read_spec(model_dir)
    warm_imports(spec, model_dir)
    tower = "transformers.models.llava.modeling_llava" if spec.family == "llava" else \
        "transformers.models.qwen2_vl.modeling_qwen2_vl"
    assert tower in sys.modules


def test_an_instance_without_an_image_processor_builds_and_switches_to_e_with_the_reason(
        tmp_path: Path, qwen2_vl_dir: Path) -> None:
    """Warming is best effort: a P/D instance of a checkpoint without preprocessor_config.json
    serves, and its switch to E fails naming the file."""
    for f in qwen2_vl_dir.iterdir():
        if f.name != "preprocessor_config.json":
            (tmp_path / f.name).symlink_to(f)
    inst = InstanceRuntime(WorkerSettings(model=str(tmp_path), instance_id="np", num_kv_blocks=32, num_mm_blocks=16))

    async def both() -> None:
        await inst.switch("D")
        with pytest.raises(UnsupportedCheckpointError, match="no preprocessor_config.json"):
            await inst.switch("E")

    try:
        asyncio.run(both())
        assert inst.role == "D"
    finally:
        inst.teardown()
