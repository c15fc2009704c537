"""Decode migration in the orchestrator (EPDServe §3.2.4 role switching, drains): a
`migrating` event continues the decode on another decode instance under a fresh id,
appending to the same stream, and a decode instance that refuses (503) before its first
event is passed over for another with the same KV. Against fake workers (fakeworkers.py)."""

from __future__ import annotations

import pytest
from fakeworkers import FakeCluster, collect, expected_tokens, request, status

from triptych.router.backend import BackendError
from triptych.stage_protocol import KVSource, MigratingEvent


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
            await collect(cluster.orchestrator(), request(max_tokens=8))
        assert err.value.status_code == 503
