"""The decode pool's bound and the content-hash check (worker/admission.py)."""

from __future__ import annotations

import asyncio
import hashlib
import threading

import pytest

from triptych.worker.admission import DecodePool, decode_payload
from triptych.worker.errors import BadPayloadError, OverloadedError, http_status


async def test_a_full_pool_refuses_with_503_and_recovers() -> None:
    pool = DecodePool(workers=1, max_pending=2)
    gate = threading.Event()
    try:
        running = [asyncio.create_task(pool.run(gate.wait, 10)) for _ in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(OverloadedError) as info:
            await pool.run(lambda: "never")
        assert http_status(info.value) == 503
        gate.set()
        assert await asyncio.gather(*running) == [True, True]
        assert await pool.run(lambda: "ok") == "ok" and pool.pending == 0
    finally:
        gate.set()
        pool.close()


async def test_pool_work_runs_off_the_event_loop_thread() -> None:
    pool = DecodePool()
    try:
        assert await pool.run(threading.get_ident) != threading.get_ident()
    finally:
        pool.close()


def test_bytes_must_hash_to_their_content_hash() -> None:
    data, other = b"\x89PNG real image", b"\x89PNG another image"
    h = hashlib.sha256(data).hexdigest()
    assert decode_payload({h: data}) == {h: data}  # raw bytes, as the stage frame carries them
    with pytest.raises(BadPayloadError, match="hashes to") as info:
        decode_payload({h: other})
    assert http_status(info.value) == 400
