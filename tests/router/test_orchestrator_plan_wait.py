"""Planning while an instance is mid-switch (EPDServe §3.2.4 role switching) or out of
rotation after one failure: a request that needs a stage whose every instance is switching
or recovering waits, bounded by `plan_wait_s`, on the registry's change event for one to
come back; with no instance of the stage and none switching or recovering (given up on
after DEAD_AFTER_FAILURES failures) it gets its 503 at once. Against fake workers
(fakeworkers.py)."""

from __future__ import annotations

import asyncio

import pytest
from fakeworkers import FakeCluster, collect, expected_tokens, request

from triptych.router.backend import BackendError
from triptych.router.registry import DEAD_AFTER_FAILURES
from triptych.topology import InstanceType

GUARD_S = 20.0  # a hang guard only: every test ends long before it or fails on its own


def spy_waits(cluster: FakeCluster) -> list[float]:
    """Record every wait the orchestrator does on the registry's change event."""
    waits: list[float] = []
    wait = cluster.registry.wait_for_change

    async def recorded(timeout_s: float) -> bool:
        waits.append(timeout_s)
        return await wait(timeout_s)

    cluster.registry.wait_for_change = recorded  # type: ignore[method-assign]
    return waits


async def test_a_request_planned_while_the_only_prefill_instance_switches_runs_after_the_switch():
    async with FakeCluster("1P1D") as cluster:
        p0 = cluster["p0"]
        cluster.registry.mark_switching(p0.url, "EP")
        waits = spy_waits(cluster)
        runs_before_the_end: list[int] = []

        async def end_switch() -> None:
            await asyncio.sleep(0.3)
            runs_before_the_end.append(len(p0.runs))
            p0.role = InstanceType.EP  # the worker serves its new role; the router's probe sees it
            await cluster.registry.switch_ended(cluster.client, p0.url)

        switch = asyncio.create_task(end_switch())
        # plan_wait_s far above the switch: the request ends because the change woke it.
        tokens, finish = await asyncio.wait_for(collect(cluster.orchestrator(plan_wait_s=60.0),
                                                        request(max_tokens=5)), GUARD_S)
        await switch
        assert tokens == expected_tokens(request(max_tokens=5)) and finish == "length"
        assert runs_before_the_end == [0]  # nothing went to p0 while it switched
        assert [r.stages for r in p0.runs] == [["prefill"]] and waits
        assert cluster.decisions("prefill", "no_instance") == 0


async def test_the_only_decode_instance_switching_back_to_decode_is_waited_for():
    """A switch that keeps the stage (the worker reports its old role again, as after a
    refused switch) also ends the wait."""
    async with FakeCluster("1P1D") as cluster:
        d0 = cluster["d0"]
        cluster.registry.mark_switching(d0.url, "P")
        asyncio.get_running_loop().call_later(
            0.2, lambda: asyncio.ensure_future(cluster.registry.switch_ended(cluster.client, d0.url)))
        tokens, _ = await asyncio.wait_for(collect(cluster.orchestrator(plan_wait_s=60.0), request(max_tokens=4)),
                                           GUARD_S)
        assert tokens == expected_tokens(request(max_tokens=4))
        assert [r.stages for r in d0.runs] == [["decode"]]


async def test_no_instance_of_a_stage_and_none_switching_is_a_503_at_once():
    async with FakeCluster("1E1P1D") as cluster:
        for _ in range(DEAD_AFTER_FAILURES):  # gone (a SIGKILL): given up on
            cluster.registry.mark_failed(cluster["d0"].url)
        cluster.registry.mark_switching(cluster["e0"].url, "P")  # switching, but no decode before or after
        waits = spy_waits(cluster)
        with pytest.raises(BackendError) as err:
            await asyncio.wait_for(collect(cluster.orchestrator(plan_wait_s=60.0), request()), GUARD_S)
        assert err.value.status_code == 503 and err.value.retry_after is not None
        assert waits == [] and cluster["p0"].runs == []
        assert cluster.decisions("decode", "no_instance") == 1


async def test_a_switch_outlasting_the_plan_wait_is_a_503():
    async with FakeCluster("1P1D") as cluster:
        cluster.registry.mark_switching(cluster["d0"].url, "PD")  # and it never comes back
        waits = spy_waits(cluster)
        with pytest.raises(BackendError) as err:
            await asyncio.wait_for(collect(cluster.orchestrator(plan_wait_s=0.3), request()), GUARD_S)
        assert err.value.status_code == 503 and "decode" in err.value.message
        assert waits and all(w <= 0.3 for w in waits)  # never past the bound
        assert cluster["p0"].runs == [] and cluster["d0"].runs == []
        assert cluster.decisions("decode", "no_instance") == 1


async def test_the_plan_wait_never_outlasts_the_stage_deadline():
    async with FakeCluster("1P1D") as cluster:
        cluster.registry.mark_switching(cluster["p0"].url, "D")
        waits = spy_waits(cluster)
        with pytest.raises(BackendError):
            await asyncio.wait_for(collect(cluster.orchestrator(plan_wait_s=60.0, stage_timeout_s=0.2),
                                           request()), GUARD_S)
        assert waits and all(w <= 0.2 for w in waits)


async def test_an_instance_that_stops_answering_mid_switch_is_no_longer_waited_for():
    """Only a switch that ends is waited for: a switch whose worker does not answer the
    post-switch probe, or a worker that says it is switching and then stops answering
    probes, no longer counts as switching (requests get their 503 at once)."""
    import httpx

    from triptych.router.registry import DEAD_AFTER_FAILURES, Registry
    from triptych.topology import Stage

    answering = True

    async def health(request: httpx.Request) -> httpx.Response:
        if not answering:
            raise httpx.ConnectError("gone")
        return httpx.Response(200, json={"role": "D", "status": "switching", "target_role": "P",
                                         "instance_id": "D-0", "load": 0})

    registry = Registry(urls=["http://d0"])
    async with httpx.AsyncClient(transport=httpx.MockTransport(health)) as client:
        await registry.refresh(client)
        assert [i.url for i in registry.switching(Stage.DECODE)] == ["http://d0"]
        answering = False
        for _ in range(DEAD_AFTER_FAILURES - 1):
            await registry.refresh(client)
        assert registry.switching(Stage.DECODE)  # a probe or two may time out under load
        await registry.refresh(client)
        assert registry.switching(Stage.DECODE) == []

        registry.mark_switching("http://d0", "P")
        assert registry.switching(Stage.PREFILL)
        await registry.switch_ended(client, "http://d0")
        assert registry.switching(Stage.PREFILL) == [] and not registry.instances["http://d0"].ready


async def test_the_only_decode_instance_out_after_one_failure_is_waited_for_and_used():
    """Under overload one slow probe or broken stream takes the only D out of rotation until
    its next good probe; requests meanwhile are held, not failed."""
    async with FakeCluster("1P1D") as cluster:
        d0 = cluster["d0"]
        cluster.registry.mark_failed(d0.url)
        waits = spy_waits(cluster)
        asyncio.get_running_loop().call_later(  # the registry's next poll finds it answering
            0.2, lambda: asyncio.ensure_future(cluster.registry.refresh(cluster.client)))
        tokens, _ = await asyncio.wait_for(collect(cluster.orchestrator(plan_wait_s=60.0), request(max_tokens=4)),
                                           GUARD_S)
        assert tokens == expected_tokens(request(max_tokens=4))
        assert [r.stages for r in d0.runs] == [["decode"]] and waits
        assert cluster.decisions("decode", "no_instance") == 0


async def test_a_recovering_instance_that_stays_down_ends_the_wait_once_given_up_on():
    async with FakeCluster("1P1D") as cluster:
        registry = cluster.registry
        registry.remove_url(cluster["d0"].url)
        gone = registry.add_url("http://127.0.0.1:9")  # nothing listens: every probe fails
        gone.role, gone.failures = InstanceType.D, 1

        async def poll() -> None:
            while True:
                await asyncio.sleep(0.1)
                await registry.refresh(cluster.client)

        poller = asyncio.create_task(poll())
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            with pytest.raises(BackendError) as err:
                await asyncio.wait_for(collect(cluster.orchestrator(plan_wait_s=60.0), request()), GUARD_S)
        finally:
            poller.cancel()
        assert err.value.status_code == 503 and gone.failures >= DEAD_AFTER_FAILURES
        assert loop.time() - started < 5.0  # woken when given up on, not at plan_wait_s
        assert cluster.decisions("decode", "no_instance") == 1


async def test_a_stage_whose_only_instance_failed_the_attempt_is_retried_there_once_it_is_back():
    """The only E drops an encode run's stream (CI saw a reset mid-answer on a loaded
    machine): with no other E to retry on, the retry waits for that one to come back
    instead of a 503 for want of another."""
    from fakeworkers import crash_after

    async with FakeCluster("1E1P1D") as cluster:
        e0 = cluster["e0"]
        e0.script(crash_after(0))
        waits = spy_waits(cluster)
        asyncio.get_running_loop().call_later(  # the registry's next poll finds it answering
            0.3, lambda: asyncio.ensure_future(cluster.registry.refresh(cluster.client)))
        req = request(images=("cat",), max_tokens=4)
        tokens, finish = await asyncio.wait_for(collect(cluster.orchestrator(plan_wait_s=60.0), req), GUARD_S)
        assert tokens == expected_tokens(req) and finish == "length"
        assert [r.stages for r in e0.runs] == [["encode"], ["encode"]] and waits
        assert cluster.decisions("encode", "no_instance") == 0
