"""A stage run's preparation: refusals are typed (and their statuses come from one table),
and a failure after some pulls gives back everything pulled so far."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from triptych.stage_protocol import KVSource, MMSource, StageRequest
from triptych.topology import InstanceType
from triptych.worker import stage_run
from triptych.worker.engine.request import Request, RequestOutput, RequestValidationError
from triptych.worker.errors import BadPayloadError, NotServingError, http_status
from triptych.worker.instance import InstanceRuntime
from triptych.worker.migration import PullFailedError
from triptych.worker.settings import WorkerSettings
from triptych.worker.stage_run import prepare


class FakeMigration:
    def __init__(self, kv_fails: bool, gate: asyncio.Event | None = None) -> None:
        self.kv_fails = kv_fails
        self.gate = gate  # the KV pull's READ ends when it is set
        self.pulling = False
        self.released: list[Any] = []
        self.freed: list[list[int]] = []

    async def pull_embeddings(self, sources: list[MMSource]) -> list[Any]:
        return [f"entry-{s.content_hash}" for s in sources]

    async def pull_kv(self, src: KVSource, token_ids: Any = (), mm_items: Any = ()) -> list[int]:
        self.pulling = True
        if self.gate is not None:
            await asyncio.wait_for(self.gate.wait(), timeout=10)
        self.pulling = False
        if self.kv_fails:
            raise PullFailedError("pulling pd blocks failed: peer gone")
        return [3, 1]

    def release_embeddings(self, entries: list[Any]) -> None:
        self.released.extend(entries)

    def discard_kv(self, block_ids: list[int]) -> None:
        self.freed.append(block_ids)


class FakeAdmission:
    """Records what the pull was doing when the request was admitted."""

    def __init__(self, migration: FakeMigration, refuse: bool = False) -> None:
        self.migration = migration
        self.refuse = refuse
        self.during_pull: list[bool] = []

    def prepare(self, req: Any) -> None:
        self.during_pull.append(self.migration.pulling)
        if self.refuse:
            raise RequestValidationError("refused at admission")


def instance(role: InstanceType, migration: FakeMigration, admission: FakeAdmission | None = None) -> InstanceRuntime:
    inst = InstanceRuntime(WorkerSettings(model="unused", instance_id="w1"))
    inst.engine = SimpleNamespace(role=role, admission=admission or FakeAdmission(migration))  # type: ignore[assignment]
    inst.migration = migration  # type: ignore[assignment]
    return inst


def stage_request(**kw: Any) -> StageRequest:
    return StageRequest.model_validate({"request_id": "r1", "stages": ["decode"], "prompt_token_ids": [1, 2],
                                        **kw})


SOURCES = {"mm_sources": [{"content_hash": "h1", "num_tokens": 4, "handle": {}}],
           "kv_source": {"handle": {}, "num_tokens": 2, "first_token": 7}}


async def test_failed_kv_pull_releases_the_pulled_embeddings() -> None:
    migration = FakeMigration(kv_fails=True)
    with pytest.raises(PullFailedError) as err:
        await prepare(instance(InstanceType.PD, migration), stage_request(**SOURCES))
    assert http_status(err.value) == 502
    assert migration.released == ["entry-h1"] and migration.freed == []


async def test_request_that_cannot_be_built_frees_its_pulled_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_a: Any, **_kw: Any) -> None:
        raise RequestValidationError("refused")

    monkeypatch.setattr(stage_run, "Request", refuse)
    migration = FakeMigration(kv_fails=False)
    with pytest.raises(RequestValidationError):
        await prepare(instance(InstanceType.PD, migration), stage_request(**SOURCES))
    assert migration.released == ["entry-h1"] and migration.freed == [[3, 1]]


async def test_refusals_before_any_pull() -> None:
    migration = FakeMigration(kv_fails=False)
    with pytest.raises(NotServingError, match="does not run stage"):
        await prepare(instance(InstanceType.E, migration), stage_request(**SOURCES))
    with pytest.raises(BadPayloadError) as err:
        await prepare(instance(InstanceType.PD, migration), stage_request(images={"h": b"not the bytes hashed to h"}))
    assert http_status(err.value) == 400
    draining = instance(InstanceType.PD, migration)
    draining.draining = True
    with pytest.raises(NotServingError, match="draining"):
        await prepare(draining, stage_request())
    assert migration.released == [] and migration.freed == []


async def test_decode_is_admitted_while_its_kv_pull_is_in_flight() -> None:
    gate = asyncio.Event()
    migration = FakeMigration(kv_fails=False, gate=gate)
    admission = FakeAdmission(migration)
    run = asyncio.ensure_future(prepare(instance(InstanceType.D, migration, admission),
                                        stage_request(kv_source=SOURCES["kv_source"])))
    for _ in range(100):  # until the run waits for nothing but the READ
        await asyncio.sleep(0)
        if admission.during_pull:
            break
    assert admission.during_pull == [True] and not run.done()
    gate.set()
    req, _ = await asyncio.wait_for(run, timeout=10)
    assert req.prefilled.block_ids == [3, 1] and migration.freed == []


async def test_refused_at_admission_during_the_pull_frees_the_blocks_once_the_read_ends() -> None:
    gate = asyncio.Event()
    migration = FakeMigration(kv_fails=False, gate=gate)
    run = asyncio.ensure_future(prepare(instance(InstanceType.D, migration, FakeAdmission(migration, refuse=True)),
                                        stage_request(kv_source=SOURCES["kv_source"])))
    for _ in range(100):
        await asyncio.sleep(0)
    assert not run.done() and migration.freed == []  # the READ may still write into them
    gate.set()
    with pytest.raises(RequestValidationError) as err:
        await asyncio.wait_for(run, timeout=10)
    assert http_status(err.value) == 400 and migration.freed == [[3, 1]]


async def test_the_routers_stream_interval_reaches_the_engines_request() -> None:
    # A request the client takes whole: the router asks for its tokens in groups (driver.py).
    for asked in (None, 16):
        migration = FakeMigration(kv_fails=False)
        req, _ = await prepare(instance(InstanceType.D, migration),
                               stage_request(kv_source=SOURCES["kv_source"], stream_interval=asked))
        assert req.stream_interval == asked
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        stage_request(stream_interval=0)


class _StepEngine:
    """What `stage_run.stream` uses of an engine: `generate_batches` yields the batches the
    test puts, and keeps the `direct` take it was given."""

    def __init__(self) -> None:
        self.role = InstanceType.EPD
        self.batches: asyncio.Queue[list[RequestOutput]] = asyncio.Queue()
        self.direct: Any = None

    async def generate_batches(self, req: Any, timeout_s: Any = None, direct: Any = None):
        self.direct = direct
        while True:
            batch = await self.batches.get()
            yield batch
            if batch[-1].finished:
                return


async def test_on_a_channel_plain_tokens_after_the_first_batch_are_written_by_the_step_callback() -> None:
    from triptych.worker.stage_run import stream

    for stages in (["prefill", "decode"], ["decode"]):  # a decode hop's first token ends its hop
        engine, migration = _StepEngine(), FakeMigration(kv_fails=False)
        inst = instance(InstanceType.EPD, migration)
        inst.engine = engine  # type: ignore[assignment]
        written: list[bytes] = []
        sreq = stage_request(stages=stages)
        run = stream(inst, sreq, Request("r1", [1, 2]), ["entry-h1"], write=written.append)
        lines = asyncio.ensure_future(anext(run))
        await asyncio.sleep(0)
        assert engine.direct is not None and not engine.direct([RequestOutput("r1", [5], num_output_tokens=1)])
        engine.batches.put_nowait([RequestOutput("r1", [5], num_output_tokens=1)])
        assert b'"token_ids":[5]' in await asyncio.wait_for(lines, 1)  # the first batch: through the run
        assert migration.released == ["entry-h1"]
        assert engine.direct([RequestOutput("r1", [6], num_output_tokens=2), RequestOutput("r1", [7], num_output_tokens=3)])
        assert written == [b'{"type":"tokens","token_ids":[6,7],"index":0}\n']
        # Anything else goes through the run.
        assert not engine.direct([RequestOutput("r1", [8], num_output_tokens=4, logprobs=[{"token_id": 8}])])
        assert not engine.direct([RequestOutput("r1", [8], finished=True, num_output_tokens=4)])
        engine.batches.put_nowait([RequestOutput("r1", [8], finished=True, num_output_tokens=4)])
        assert b'"finished"' in await asyncio.wait_for(anext(run), 1)
        with pytest.raises(StopAsyncIteration):
            await anext(run)
        assert not engine.direct([RequestOutput("r1", [9], num_output_tokens=5)])  # ended: nothing more
        assert len(written) == 1, stages
