"""Runs over the workers' event channels (router/stage_channel.py, worker/stage_channel.py):
fakes that offer channels (the worker's own channel code) against the real orchestrator.
The same answers as with a stream per run, one channel per worker, and every way a run on a
channel can fail sorted as its stream's failure would be: retried before the first token,
cancelled on the worker when the router stops reading, the channel reopened after it died."""

from __future__ import annotations

import asyncio
import time

import pytest
from fakeworkers import (
    HANG,
    FakeCluster,
    collect,
    crash_after,
    error,
    expected_tokens,
    first_events,
    hang_after,
    request,
)

from triptych.router.backend import BackendError

SILENCE_S = 1.0


async def _until(check, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.01)


async def test_runs_share_one_channel_per_worker_and_answer_as_streams_do():
    async with FakeCluster("1E1P1D", channels=True) as cluster:
        orch = cluster.orchestrator()
        reqs = [request(f"r{i}", images=("a",) if i % 2 else (), max_tokens=5) for i in range(6)]
        results = await asyncio.gather(*(collect(orch, r) for r in reqs))
        assert results == [(expected_tokens(r), "length") for r in reqs]
        assert {w.name: w.channels_opened for w in cluster.workers.values()} == {"e0": 1, "p0": 1, "d0": 1}
        assert cluster.parked() == set() and cluster.aborts() == set()
        assert all(not w.running for w in cluster.workers.values())


async def test_a_worker_without_channels_gets_a_stream_per_run():
    async with FakeCluster("1P1D") as cluster:  # fakes that answer 404 to the channel
        orch = cluster.orchestrator()
        for name in ("a", "b"):
            assert await collect(orch, request(name)) == (expected_tokens(request(name)), "length")
        assert orch.stages.channels._unsupported == {w.url for w in cluster.workers.values()}


async def test_channels_off_never_opens_one():
    async with FakeCluster("1P1D", channels=True) as cluster:
        orch = cluster.orchestrator(stage_channel=False)
        assert await collect(orch, request()) == (expected_tokens(request()), "length")
        assert [w.channels_opened for w in cluster.workers.values()] == [0, 0]


@pytest.mark.parametrize("fault", [crash_after(0), hang_after(0), error(500)], ids=["channel drops", "silence",
                                                                                    "500 event"])
async def test_a_prefill_failing_on_its_channel_is_retried_elsewhere(fault):
    async with FakeCluster("2P1D", channels=True) as cluster:
        cluster["p0"].script(fault)
        orch = cluster.orchestrator(stage_timeout_s=SILENCE_S)
        assert await collect(orch, request()) == (expected_tokens(request()), "length")
        assert [r.id for r in cluster["p1"].runs] == ["req.retry1"]
        await _until(lambda: not cluster["p0"].running)  # the failed run ended on p0 too


async def test_a_dropped_channel_is_reopened_for_the_next_run():
    async with FakeCluster("1P2D", channels=True) as cluster:
        cluster["d0"].script(crash_after(2))
        orch = cluster.orchestrator()
        with pytest.raises(BackendError) as err:
            await collect(orch, request("first", max_tokens=6))
        assert err.value.status_code == 502 and "after streaming began" in err.value.message
        cluster.registry.instances[cluster["d0"].url].ready = True  # back in rotation, as a probe would put it
        for name in ("second", "third"):  # round-robin: one of them goes to d0
            assert await collect(orch, request(name)) == (expected_tokens(request(name)), "length")
        assert [r.id for r in cluster["d0"].runs][-1] in ("second", "third")
        assert cluster["d0"].channels_opened == 2


async def test_silence_on_a_channel_cancels_the_run_on_the_worker():
    async with FakeCluster("1P1D", channels=True) as cluster:
        cluster["d0"].script(hang_after(2))
        orch = cluster.orchestrator(stage_timeout_s=SILENCE_S)
        with pytest.raises(BackendError) as err:
            await asyncio.wait_for(collect(orch, request(max_tokens=6)), timeout=10)
        assert err.value.status_code == 504
        await _until(lambda: cluster["d0"].cancels == ["0"] and not cluster["d0"].running)


async def test_a_client_leaving_mid_stream_cancels_the_run_and_aborts():
    async with FakeCluster("1P1D", channels=True) as cluster:
        cluster["d0"].script(hang_after(1))
        orch = cluster.orchestrator()
        got = await first_events(orch, request(max_tokens=8), count=2)
        assert [e.token_ids for e in got] == [[t] for t in expected_tokens(request())[:2]]
        await _until(lambda: not cluster["d0"].running)
        assert ("d0", "req") in cluster.aborts() and cluster["d0"].cancels == ["0"]
        assert orch.inflight == 0


async def test_a_channel_the_worker_no_longer_holds_is_retried_and_reopened():
    """The router posts a run for a channel the worker has just dropped (its answer says
    `channel_gone`): that run streams on its own from the same worker, which stays in
    rotation, and the next run there opens a new channel."""
    async with FakeCluster("2P1D", channels=True) as cluster:
        orch = cluster.orchestrator()
        assert await collect(orch, request("warm")) == (expected_tokens(request("warm")), "length")
        p0 = cluster["p0"]
        assert p0.channels is not None and p0.channels_opened == 1
        p0.channels._open.clear()  # forgotten on the worker; the router's reader has not noticed
        for name in ("a", "b", "c", "d"):  # round-robin: two of them go to p0
            assert await collect(orch, request(name)) == (expected_tokens(request(name)), "length")
        assert [r.id for r in p0.runs] == ["warm", "b", "d"]  # no retry: "b" ran where it was sent
        assert p0.channels_opened == 2 and cluster.registry.instances[p0.url].ready


async def test_a_run_still_going_after_its_terminal_event_is_stopped_on_the_worker():
    """A hop's reader may stop at its terminal event (an encode's hand-over; a live
    hand-over's source, which decodes on until the reader cuts over). On a channel, as on a
    stream, a run that has not ended a moment later is stopped there, not left running."""
    async with FakeCluster("1E1P1D", channels=True) as cluster:
        cluster["e0"].script(lambda sreq, normal: [*normal, HANG])  # the hand-over, then open
        orch = cluster.orchestrator()
        req = request(images=("a",))
        assert await collect(orch, req) == (expected_tokens(req), "length")
        await _until(lambda: cluster["e0"].cancels == ["0"] and not cluster["e0"].running)
        assert cluster["p0"].cancels == [] and cluster["d0"].cancels == []  # ended by themselves
