"""The orchestrator against fake workers that speak the real stage protocol on loopback
(fakeworkers.py): the path each topology takes, retries under fresh ids, intra-request
parallel encoding (EPDServe §3.2.2), cache affinity, abort fan-out and hop deadlines."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
from fakeworkers import (
    FakeCluster,
    aborted,
    collect,
    crash_after,
    error,
    expected_tokens,
    first_events,
    garbage,
    gate,
    hang_after,
    request,
    status,
)

from triptych.router.backend import BackendError


def runs(cluster: FakeCluster) -> list[tuple[str, str, list[str], list[str]]]:
    """Every run as (worker, request id, stages, images it was asked to encode), by worker name."""
    return sorted((w.name, r.id, r.stages, list(r.request.images))
                  for w in cluster.workers.values() for r in w.runs)


def sources(cluster: FakeCluster, worker: str) -> list[tuple[str, str, str]]:
    """The embeddings a worker's last run pulled: (content hash, holder, id it is parked under)."""
    return [(s.content_hash, s.handle["agent"], s.handle["request_id"])
            for s in cluster[worker].runs[-1].request.mm_sources]


# -- the path --------------------------------------------------------------------------------
@pytest.mark.parametrize(("topology", "expected"), [
    ("EPD", [("epd0", "req", ["encode", "prefill", "decode"], ["a"])]),
    ("1E1P1D", [("d0", "req", ["decode"], []), ("e0", "req.encode", ["encode"], ["a"]),
                ("p0", "req", ["prefill"], [])]),
    ("1EP1D", [("d0", "req", ["decode"], []), ("ep0", "req", ["encode", "prefill"], ["a"])]),
    # ED encodes under its own id: it decodes the same request later, while the encode is parked.
    ("1ED1P", [("ed0", "req", ["decode"], []), ("ed0", "req.encode", ["encode"], ["a"]),
               ("p0", "req", ["prefill"], [])]),
    ("1E1PD", [("e0", "req.encode", ["encode"], ["a"]), ("pd0", "req", ["prefill", "decode"], [])]),
])
async def test_each_topology_runs_its_plan_and_carries_the_handles(topology, expected):
    async with FakeCluster(topology) as cluster:
        req = request(images=("a",), max_tokens=5)
        tokens, reason = await collect(cluster.orchestrator(), req)
        assert (tokens, reason) == (expected_tokens(req), "length")
        assert runs(cluster) == expected
        assert cluster.parked() == set()  # every hand-over was pulled, so every block is freed
        assert cluster.aborts() == set()


async def test_image_bytes_reach_the_encoder_raw_in_the_stage_frame():
    # The fake reads the frame as a worker does (decode_stage_request): the exact bytes the
    # client sent arrive, only on the run that encodes them, and none goes as JSON.
    async with FakeCluster("1E1P1D") as cluster:
        req = request(images=("a", "b"), max_tokens=2)
        await collect(cluster.orchestrator(), req)
        (encode,) = cluster["e0"].runs
        assert encode.request.images == {"a": b"bytes of a", "b": b"bytes of b"}
        assert cluster["p0"].runs[0].request.images == {} and cluster["d0"].runs[0].request.images == {}
        assert "images" not in encode.request.model_dump_json()


async def test_next_hop_does_not_wait_for_a_finished_hops_stream_to_end():
    # E sends its hand-over, then holds its answer open until P has received the prefill:
    # the router must start P without reading E's answer to its end (that end is read in
    # the background), and the E connection, read to its end then, is reused.
    async with FakeCluster("1E1P1D") as cluster:
        held = asyncio.Event()
        seen_held: list[bool] = []

        def prefill(sreq, normal):
            seen_held.append(held.is_set())
            held.set()  # now E may end its answer
            return normal

        cluster["e0"].script(lambda sreq, normal: [*normal, held])
        cluster["p0"].script(prefill)
        orch = cluster.orchestrator()
        req = request(images=("a",), max_tokens=3)
        assert await collect(orch, req) == (expected_tokens(req), "length")
        assert seen_held == [False]  # P started while E's answer was still open
        # A second request reuses the three connections: E's went back to the pool.
        req2 = request("req2", images=("b",), max_tokens=3)
        assert await collect(orch, req2) == (expected_tokens(req2), "length")
        opened = sum(s.value for m in cluster.metrics.collect() for s in m.samples
                     if s.name == "triptych_frontend_worker_connections_opened_total")
        assert opened == 0  # the cluster's first health probes opened one to each; none since


async def test_text_request_skips_encode_and_decode_continues_from_the_kv_handle():
    async with FakeCluster("1E1P1D") as cluster:
        req = request(max_tokens=3)
        assert await collect(cluster.orchestrator(), req) == (expected_tokens(req), "length")
        assert runs(cluster) == [("d0", "req", ["decode"], []), ("p0", "req", ["prefill"], [])]
        kv = cluster["d0"].runs[0].request.kv_source
        assert kv is not None and kv.handle == {"agent": "p0", "request_id": "req"}


async def test_decode_hop_deadline_grows_with_max_tokens():
    async with FakeCluster("1P1D") as cluster:
        orch = cluster.orchestrator(stage_timeout_s=7, per_token_timeout_s=0.5)
        await collect(orch, request(max_tokens=10))
        assert cluster["p0"].runs[0].request.timeout_s == 7
        assert cluster["d0"].runs[0].request.timeout_s == 7 + 10 * 0.5


async def test_a_request_taken_whole_asks_its_workers_for_grouped_tokens():
    # stream=false: nobody sees the tokens in between, so the workers hand them over
    # `whole_interval` at a time; a streamed request leaves each worker its own setting.
    async with FakeCluster("1E1P1D") as cluster:
        orch = cluster.orchestrator(whole_interval=12)
        streamed, whole = request("s", images=("img",)), replace(request("w", images=("img",)), stream=False)
        for req in (streamed, whole):
            assert await collect(orch, req) == (expected_tokens(req), "length")
        asked = {(w, r.id, tuple(r.stages)): r.request.stream_interval for w in ("e0", "p0", "d0")
                 for r in cluster[w].runs}
        assert asked == {("e0", "s.encode", ("encode",)): None, ("p0", "s", ("prefill",)): None,
                         ("d0", "s", ("decode",)): None, ("e0", "w.encode", ("encode",)): None,
                         ("p0", "w", ("prefill",)): 12, ("d0", "w", ("decode",)): 12}


# -- retries -------------------------------------------------------------------------------
SILENCE_S = 1.0  # the stage timeout where a fault is silence (healthy fakes answer in milliseconds)
FAULTS = {"503": status(503), "500 event": error(500), "crash": crash_after(0), "silence": hang_after(0),
          "not the protocol": garbage(), "429": status(429)}


@pytest.mark.parametrize("fault", FAULTS.values(), ids=FAULTS.keys())
async def test_encoder_failing_before_prefill_is_retried_on_the_other_under_a_fresh_id(fault):
    async with FakeCluster("2E1P1D") as cluster:
        cluster["e0"].script(fault)
        orch = cluster.orchestrator(stage_timeout_s=SILENCE_S)
        req = request(images=("a",))
        assert await collect(orch, req) == (expected_tokens(req), "length")
        assert runs(cluster) == [("d0", "req.retry1", ["decode"], []),
                                 ("e0", "req.encode", ["encode"], ["a"]),
                                 ("e1", "req.retry1.encode", ["encode"], ["a"]),
                                 ("p0", "req.retry1", ["prefill"], [])]
        assert sources(cluster, "p0") == [("a", "e1", "req.retry1.encode")]
        assert not cluster.registry.instances[cluster["e0"].url].ready  # out of rotation until probed
        assert cluster.decisions("encode", "retried") == 1


@pytest.mark.parametrize("fault", [*FAULTS.values(), aborted()], ids=[*FAULTS.keys(), "finished: abort"])
async def test_prefill_failing_before_the_first_token_is_retried_elsewhere(fault):
    async with FakeCluster("1E2P1D") as cluster:
        cluster["p0"].script(fault)
        orch = cluster.orchestrator(stage_timeout_s=SILENCE_S)
        req = request(images=("a",))
        assert await collect(orch, req) == (expected_tokens(req), "length")
        # e0's first hand-over may still be parked (p0 never pulled it): the retry's own id
        # is what lets e0 accept the request again.
        assert runs(cluster) == [("d0", "req.retry1", ["decode"], []),
                                 ("e0", "req.encode", ["encode"], ["a"]),
                                 ("e0", "req.retry1.encode", ["encode"], ["a"]),
                                 ("p0", "req", ["prefill"], []),
                                 ("p1", "req.retry1", ["prefill"], [])]
        assert sources(cluster, "p1") == [("a", "e0", "req.retry1.encode")]
        assert cluster.decisions("prefill", "retried") == 1


async def test_a_retried_attempts_parked_work_is_withdrawn_at_once():
    """The failed attempt's encode sits parked at e0 under a lease for a pull that will not
    come (p0 failed): the router aborts it when it retries, instead of leaving it held
    until the lease expires (a switching instance would wait for it)."""
    async with FakeCluster("1E2P1D") as cluster:
        cluster["p0"].script(status(503))
        req = request(images=("a",))
        assert await collect(cluster.orchestrator(), req) == (expected_tokens(req), "length")
        deadline = time.monotonic() + 5
        while ("e0", "req.encode") not in cluster.aborts() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert {("e0", "req.encode"), ("p0", "req")} <= cluster.aborts()
        assert cluster.parked() == set()
        assert not any(i.startswith("req.retry1") for _, i in cluster.aborts())  # the retry succeeded


async def test_every_attempt_failing_ends_in_a_503_and_aborts():
    async with FakeCluster("3P1D") as cluster:
        for name in ("p0", "p1", "p2"):
            cluster[name].script(error(500, f"{name} is broken"))
        orch = cluster.orchestrator(max_attempts=3)
        with pytest.raises(BackendError) as err:
            await collect(orch, request())
        last = next(w for w in cluster.workers.values() if [r.id for r in w.runs] == ["req.retry2"])
        assert err.value.status_code == 503
        # The client learns no worker URL and no worker response body (they are logged).
        assert err.value.message == "request failed on every attempt (3); try again later"
        assert last.url not in err.value.message
        assert err.value.retry_after == orch.config.retry_after_s
        assert sorted(r.id for w in ("p0", "p1", "p2") for r in cluster[w].runs) == ["req", "req.retry1",
                                                                                   "req.retry2"]
        assert {(w, i) for w in ("p0", "p1", "p2") for i in ("req", "req.retry1", "req.retry2")} <= cluster.aborts()


async def test_worker_4xx_is_the_clients_error_and_not_retried():
    async with FakeCluster("2P1D") as cluster:
        cluster["p0"].script(error(400, "prompt too long"))
        with pytest.raises(BackendError) as err:
            await collect(cluster.orchestrator(), request())
        assert (err.value.status_code, err.value.message) == (400, "prompt too long")
        assert cluster["p1"].runs == [] and cluster.registry.instances[cluster["p0"].url].ready


async def test_failure_after_the_first_token_ends_the_request_without_retry():
    async with FakeCluster("1P2D") as cluster:
        cluster["d0"].script(crash_after(2))
        orch = cluster.orchestrator()
        got: list[int] = []
        with pytest.raises(BackendError) as err:
            async for event in orch.generate(request(max_tokens=6)):
                got += event.token_ids
        assert err.value.status_code == 502 and "after streaming began" in err.value.message
        assert "http://" not in err.value.message
        assert got == expected_tokens(request(max_tokens=6))[:3]  # P's token, then D's two: never repeated
        assert cluster["d1"].runs == []
        assert {("p0", "req"), ("d0", "req")} <= cluster.aborts()


# -- intra-request parallel encoding and cache affinity --------------------------------------
async def test_images_are_spread_over_two_encoders_concurrently():
    async with FakeCluster("2E1P1D") as cluster:
        both = asyncio.Event()
        arrived: list[str] = []

        def arrive(name):
            def script(sreq, normal):
                arrived.append(name)
                if len(arrived) == 2:
                    both.set()
                return gate(both)(sreq, normal)
            return script

        cluster["e0"].script(arrive("e0"))  # each answers only once both runs arrived:
        cluster["e1"].script(arrive("e1"))  # one after the other would time out
        req = request(images=("a", "b", "c"))
        orch = cluster.orchestrator(stage_timeout_s=5)
        assert await collect(orch, req) == (expected_tokens(req), "length")
        assert cluster["e0"].encoded() == ["a", "c"] and cluster["e1"].encoded() == ["b"]
        assert sorted(sources(cluster, "p0")) == [("a", "e0", "req.encode"), ("b", "e1", "req.encode"),
                                                  ("c", "e0", "req.encode")]
        assert cluster.parked() == set()


async def test_without_parallel_encoding_one_encoder_takes_every_image():
    async with FakeCluster("2E1P1D") as cluster:
        req = request(images=("a", "b", "c"))
        assert await collect(cluster.orchestrator(parallel_encode=False), req) == (expected_tokens(req), "length")
        assert cluster["e0"].encoded() == ["a", "b", "c"] and cluster["e1"].runs == []


async def test_an_image_spread_to_the_prefill_instance_is_encoded_in_its_own_hop():
    """E then EP: the second image lands on EP, which prefills, so EP encodes it in its
    prefill hop and pulls only the first from E (no encode-only run hands to itself)."""
    async with FakeCluster("1E1EP1D") as cluster:
        req = request(images=("a", "b"))
        assert await collect(cluster.orchestrator(), req) == (expected_tokens(req), "length")
        assert runs(cluster) == [("d0", "req", ["decode"], []), ("e0", "req.encode", ["encode"], ["a"]),
                                 ("ep0", "req", ["encode", "prefill"], ["b"])]
        assert sources(cluster, "ep0") == [("a", "e0", "req.encode")]


@pytest.mark.parametrize(("affinity", "second_encoder"), [(True, "e0"), (False, "e1")])
async def test_cache_affinity_sends_a_repeated_image_to_the_encoder_that_holds_it(affinity, second_encoder):
    async with FakeCluster("2E1P1D") as cluster:
        orch = cluster.orchestrator(cache_affinity=affinity)
        await collect(orch, request("first", images=("x",)))
        await collect(orch, request("second", images=("x",)))  # round-robin alone picks e1
        assert [r.id for r in cluster[second_encoder].runs][-1] == "second.encode"
        assert cluster["e0"].runs[0].id == "first.encode"
        assert cluster.decisions("encode", "affinity") == (1 if affinity else 0)


# -- aborts and deadlines ----------------------------------------------------------------------
async def test_abort_reaches_every_instance_touched_under_every_id_used():
    async with FakeCluster("2E1P1D") as cluster:
        cluster["e0"].script(error(500))  # attempt 1: e0 fails while e1 encodes its image
        cluster["d0"].script(hang_after(1))  # attempt 2 streams, then the client leaves
        orch = cluster.orchestrator()
        got = await first_events(orch, request(images=("a", "b"), max_tokens=8), count=2)
        assert [e.token_ids for e in got] == [[t] for t in expected_tokens(request(images=("a", "b")))[:2]]
        assert cluster["e1"].encoded() == ["b", "a", "b"]  # attempt 1's b, then both on retry
        ids = {"req", "req.encode", "req.retry1", "req.retry1.encode"}
        assert cluster.aborts() == {(w, i) for w in ("e0", "e1", "p0", "d0") for i in ids}
        assert cluster.parked() == set()  # the failed attempt's parked hand-over is freed too
        assert orch.inflight == 0


async def test_a_silent_worker_fails_the_request_within_the_stage_timeout():
    async with FakeCluster("1P1D") as cluster:
        cluster["p0"].script(hang_after(0))
        orch = cluster.orchestrator(stage_timeout_s=SILENCE_S)
        started = time.monotonic()
        with pytest.raises(BackendError) as err:
            await asyncio.wait_for(collect(orch, request()), timeout=10)
        elapsed = time.monotonic() - started
        # Attempt 1 times out; the only prefill instance is then out of rotation: a clean 503.
        assert err.value.status_code == 503 and "prefill" in err.value.message
        assert SILENCE_S <= elapsed < SILENCE_S + 3, elapsed
        assert ("p0", "req") in cluster.aborts()


async def test_silence_mid_stream_is_a_504_after_the_tokens_sent():
    async with FakeCluster("1P1D") as cluster:
        cluster["d0"].script(hang_after(2))
        orch = cluster.orchestrator(stage_timeout_s=SILENCE_S)
        got: list[int] = []
        with pytest.raises(BackendError) as err:
            async with asyncio.timeout(10):
                async for event in orch.generate(request(max_tokens=6)):
                    got += event.token_ids
        assert err.value.status_code == 504 and "timed out" in err.value.message
        assert got == expected_tokens(request(max_tokens=6))[:3]
        assert {("p0", "req"), ("d0", "req")} <= cluster.aborts()


async def test_too_many_requests_in_flight_get_429():
    async with FakeCluster("1P1D") as cluster:
        cluster["d0"].script(hang_after(1))
        orch = cluster.orchestrator(max_inflight=1, retry_after_s=2.0)
        first = orch.generate(request("busy"))
        assert (await first.__anext__()).token_ids == expected_tokens(request())[:1]
        with pytest.raises(BackendError) as err:
            await collect(orch, request("refused"))
        assert (err.value.status_code, err.value.retry_after) == (429, 2.0)
        await first.aclose()  # left at P's token: D was never reached
        assert cluster.aborts() == {("p0", "busy"), ("p0", "busy.encode")} and orch.inflight == 0
