"""Decode migration in the orchestrator (EPDServe §3.2.4 role switching, drains): a
`migrating` event continues the decode on another decode instance under a fresh id,
appending to the same stream, and a decode instance that refuses (503) before its first
event is passed over for another with the same KV. Against fake workers (fakeworkers.py)."""

from __future__ import annotations

import asyncio

import pytest
from fakeworkers import FakeCluster, collect, expected_tokens, request, status

from triptych.router.backend import BackendError
from triptych.stage_protocol import KVSource, MigratingEvent, PrecopyEvent
from triptych.topology import Stage


def migrate_after(count: int):
    """Stream `count` tokens, then hand the decode over (as a switching instance does)."""
    def script(sreq, normal):
        sent = [e.token_ids[0] for e in normal[:count]]
        before = [sreq.kv_source.first_token, *sent[:-1]]
        kv = KVSource(handle={"agent": "d0", "request_id": sreq.request_id},
                      num_tokens=len(sreq.prompt_token_ids) + len(before), first_token=sent[-1], generated=before)
        return [*normal[:count], MigratingEvent(kv=kv)]
    return script


async def test_a_migrated_decode_goes_on_on_the_other_decode_instance():
    async with FakeCluster("1P2D") as cluster:
        cluster["d0"].script(migrate_after(2))
        tokens, finish = await collect(cluster.orchestrator(), request(max_tokens=8))
        assert tokens == expected_tokens(request(max_tokens=8)) and finish == "length"
        (cont,) = cluster["d1"].runs
        assert cont.id == "req.d2" and cont.stages == ["decode"]
        assert cont.request.kv_source.handle["agent"] == "d0"
        assert cont.request.kv_source.generated == tokens[:2] and cont.request.kv_source.first_token == tokens[2]


async def test_a_migrated_decode_goes_on_without_waiting_for_its_old_stream_to_end():
    """The `migrating` event is the hop's last: the next hop starts at once, while the old
    instance's answer is still open (its last bytes come whenever; the stream is not
    aborted, since its KV waits there to be pulled)."""
    still_open = asyncio.Event()  # released by the test: until then d0's answer stays open
    opened_while: list[bool] = []

    def continue_here(sreq, normal):
        opened_while.append(not still_open.is_set())
        return normal

    async with FakeCluster("1P2D") as cluster:
        cluster["d0"].script(lambda sreq, normal: [*migrate_after(2)(sreq, normal), still_open])
        cluster["d1"].script(continue_here)
        try:
            tokens, finish = await asyncio.wait_for(collect(cluster.orchestrator(), request(max_tokens=8)), 5)
        finally:
            still_open.set()
        assert tokens == expected_tokens(request(max_tokens=8)) and finish == "length"
        assert opened_while == [True]  # d1 ran the decode on while d0's stream was open
        assert cluster["d0"].aborts == []


async def test_a_decode_instance_refusing_is_passed_over_with_the_same_kv():
    async with FakeCluster("1P2D") as cluster:
        cluster["d0"].script(status(503))
        tokens, _ = await collect(cluster.orchestrator(), request(max_tokens=6))
        assert tokens == expected_tokens(request(max_tokens=6))
        assert cluster["p0"].runs[0].id == "req" and len(cluster["p0"].runs) == 1  # no new prefill
        (cont,) = cluster["d1"].runs
        assert cont.request.kv_source == cluster["d0"].runs[0].request.kv_source


async def test_a_migration_with_no_decode_instance_left_ends_the_request():
    async with FakeCluster("1P1D") as cluster:
        cluster["d0"].script(migrate_after(2))
        with pytest.raises(BackendError) as err:
            await collect(cluster.orchestrator(decode_wait_s=0.3), request(max_tokens=8))
        assert err.value.status_code == 503


async def test_the_only_decode_instance_refusing_for_a_while_is_waited_for():
    """A switch or a full queue ends: with the KV held under its lease, the router tries
    the refusing instance again after a pause instead of failing a started stream."""
    async with FakeCluster("1P1D") as cluster:
        cluster["d0"].script(status(503), status(503))
        tokens, finish = await collect(cluster.orchestrator(decode_wait_s=5.0), request(max_tokens=6))
        assert tokens == expected_tokens(request(max_tokens=6)) and finish == "length"
        assert [r.id for r in cluster["d0"].runs] == ["req", "req.d2", "req.d3"]
        assert len({r.request.kv_source.model_dump_json() for r in cluster["d0"].runs}) == 1  # the same KV
        assert len(cluster["p0"].runs) == 1  # no new prefill


async def test_a_decode_instance_the_registry_lost_for_a_moment_is_waited_for():
    """Under load a /health probe can time out and take the only D out of the registry
    for a moment; a stream with its KV in hand waits for it to come back."""
    async with FakeCluster("1P1D") as cluster:
        d0 = next(i for i in cluster.registry.instances.values() if i.can_run(Stage.DECODE))

        def vanish(sreq, normal) -> int:  # refused, and gone from the registry for 0.3 s
            d0.ready = False
            asyncio.get_running_loop().call_later(0.3, setattr, d0, "ready", True)
            return 503

        cluster["d0"].script(vanish)
        tokens, _ = await collect(cluster.orchestrator(decode_wait_s=5.0), request(max_tokens=6))
        assert tokens == expected_tokens(request(max_tokens=6))
        assert [r.id for r in cluster["d0"].runs] == ["req", "req.d2"]


async def test_a_migrated_choice_goes_on_through_the_bounded_decode_wait():
    """n > 1: one choice finishes where it is, another migrates; that choice goes on alone
    (`<id>.c1`) through `_decode`: the only other decode instance refuses it (503) at first
    and is tried again after a pause, within decode_wait_s, with the choice's own KV."""
    from dataclasses import replace

    from triptych.stage_protocol import FinishedEvent, TokensEvent

    runs: list[str] = []

    def script_of(name: str):
        return lambda sreq, normal: script(name, sreq, normal)

    def script(name, sreq, normal):
        runs.append(sreq.request_id)
        if sreq.request_id == "req":  # choice 0 runs to the end; choice 1 moves after one token
            tokens = [e.token_ids[0] for e in normal if isinstance(e, TokensEvent)]
            kv = KVSource(handle={"agent": name, "request_id": "req"}, num_tokens=len(sreq.prompt_token_ids) + 1,
                          first_token=tokens[0], generated=[sreq.kv_source.first_token])
            return [*normal[:-1], FinishedEvent(finish_reason="length"), TokensEvent(token_ids=[tokens[0]], index=1),
                    MigratingEvent(kv=kv, index=1)]
        return 503 if len(runs) == 2 else normal

    async with FakeCluster("1P2D") as cluster:
        cluster["d0"].script(script_of("d0"), script_of("d0"))
        cluster["d1"].script(script_of("d1"), script_of("d1"))
        req = request(max_tokens=6)
        req = replace(req, sampling=req.sampling.model_copy(update={"n": 2}))
        by_choice: dict[int, list[int]] = {0: [], 1: []}
        finish: dict[int, str | None] = {}
        async for event in cluster.orchestrator(decode_wait_s=5.0).generate(req):
            by_choice[event.index] += event.token_ids
            finish[event.index] = event.finish_reason or finish.get(event.index)
        answer = expected_tokens(request(max_tokens=6))
        assert by_choice == {0: answer, 1: answer[1:]} and finish == {0: "length", 1: "length"}
        assert runs == ["req", "req.c1.d1", "req.c1.d2"]
        cont = [r for w in ("d0", "d1") for r in cluster[w].runs if r.id == "req.c1.d2"][0]
        assert cont.request.kv_source.first_token == answer[1] and cont.request.sampling.n == 1


# -- live migration: pre-copy, then the hand-over on the takeover (router/takeover.py) ------


def precopy_then_migrate(precopy_at: int, migrate_at: int):
    """Stream tokens; after `precopy_at` of them offer a pre-copy (the switch began), after
    `migrate_at` hand the decode over (the switch stopped it), as a switching D does."""
    def script(sreq, normal):
        sent = [e.token_ids[0] for e in normal[:migrate_at]]
        pre = KVSource(handle={"agent": "d0", "precopy": True}, num_tokens=len(sreq.prompt_token_ids),
                       first_token=sreq.kv_source.first_token)
        before = [sreq.kv_source.first_token, *sent[:-1]]
        kv = KVSource(handle={"agent": "d0", "request_id": sreq.request_id},
                      num_tokens=len(sreq.prompt_token_ids) + len(before), first_token=sent[-1], generated=before)
        return [*normal[:precopy_at], PrecopyEvent(kv=pre), *normal[precopy_at:migrate_at], MigratingEvent(kv=kv)]
    return script


def precopy_then_finish(precopy_at: int, opened: asyncio.Event | None = None):
    """A pre-copy is offered, but the decode ends at its source before the switch stops it
    (once `opened` is set, if given: the takeover has reached its target)."""
    def script(sreq, normal):
        pre = KVSource(handle={"agent": "d0", "precopy": True}, num_tokens=len(sreq.prompt_token_ids),
                       first_token=sreq.kv_source.first_token)
        gate = [opened] if opened is not None else []
        return [*normal[:precopy_at], PrecopyEvent(kv=pre), *gate, *normal[precopy_at:]]
    return script


async def test_a_precopied_decode_goes_on_through_the_takeover_its_precopy_opened():
    async with FakeCluster("1P2D") as cluster:
        cluster["d0"].script(precopy_then_migrate(2, 4))
        tokens, finish = await collect(cluster.orchestrator(), request(max_tokens=9))
        assert tokens == expected_tokens(request(max_tokens=9)) and finish == "length"
        ((first, handed_over),) = cluster["d1"].takeovers
        assert handed_over and first.request_id.startswith("req.t") and first.stages == [Stage.DECODE]
        assert first.kv_source.handle == {"agent": "d0", "precopy": True}  # the pre-copy, ahead
        (cont,) = cluster["d1"].runs  # the hand-over went on the takeover, not a new hop
        assert cont.id == first.request_id and cont.request.kv_source.handle["agent"] == "d0"
        assert cont.request.kv_source.generated == tokens[:4] and cont.request.kv_source.first_token == tokens[4]


async def test_a_takeover_never_handed_over_is_closed():
    async with FakeCluster("1P2D") as cluster:
        opened = asyncio.Event()

        async def watch() -> None:  # d0 finishes once the takeover is open at d1
            while not cluster["d1"].takeovers_opened:
                await asyncio.sleep(0.005)
            opened.set()

        watcher = asyncio.create_task(watch())
        cluster["d0"].script(precopy_then_finish(2, opened))
        tokens, finish = await collect(cluster.orchestrator(), request(max_tokens=6))
        assert tokens == expected_tokens(request(max_tokens=6)) and finish == "length"
        await watcher
        for _ in range(200):
            if cluster["d1"].takeovers:
                break
            await asyncio.sleep(0.01)
        ((first, handed_over),) = cluster["d1"].takeovers
        assert not handed_over and cluster["d1"].runs == []


async def test_a_takeover_refused_passes_the_hand_over_to_another_decode_instance():
    """The instance the pre-copy went to refuses the hand-over (it began a switch itself):
    the decode goes on elsewhere with the same KV, all of it pulled there."""
    async with FakeCluster("1P3D") as cluster:
        cluster["d0"].script(precopy_then_migrate(2, 4))
        for name in ("d1", "d2"):
            cluster[name].takeover_status = 503
        tokens, finish = await collect(cluster.orchestrator(), request(max_tokens=9))
        assert tokens == expected_tokens(request(max_tokens=9)) and finish == "length"
        takeovers = cluster["d1"].takeovers + cluster["d2"].takeovers
        assert [handed for _, handed in takeovers] == [True]
        (cont,) = cluster["d1"].runs + cluster["d2"].runs
        assert cont.request.kv_source.handle["agent"] == "d0" and cont.request.kv_source.generated == tokens[:4]
