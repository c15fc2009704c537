"""A transfer agent lets one region go and keeps serving the others (an idle switch that
drops a cache keeps its agent: `TransferEngine.deregister`). Real NIXL (UCX) and TCP
reads over loopback, between two agents of this process."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import pytest
import torch

from triptych.worker.transfer import TransferEngine
from triptych.worker.transfer.loopback import RegionSpec, pattern

KV = RegionSpec((6, 2, 2, 4, 2, 8), "float16", seed=11)
KV_AGAIN = RegionSpec((6, 2, 2, 4, 2, 8), "float16", seed=12)
MM = RegionSpec((5, 4, 32), "bfloat16", seed=13)


def _pump(src: TransferEngine, stop: threading.Event) -> None:
    """The source's lease pump, as an instance's migration service runs it: reading its
    notifications drives its side of the connection (NIXL runs no progress thread)."""
    while not stop.wait(0.002):
        src.poll_notifications()


@pytest.fixture(params=["nixl-ucx", "tcp"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[TransferEngine, TransferEngine]]:
    kw = {"require": "nixl"} if request.param == "nixl-ucx" else {"require": "any", "nixl_plugin": "NO_SUCH_PLUGIN"}
    with TransferEngine("src", **kw) as src, TransferEngine("dst", **kw) as dst:
        assert src.transport == dst.transport == request.param
        src.register("kv", pattern(KV))
        src.register("mm", pattern(MM))
        dst.register("kv", torch.zeros(KV.shape, dtype=torch.float16))
        dst.register("mm", torch.zeros(MM.shape, dtype=torch.bfloat16))
        stop = threading.Event()
        pump = threading.Thread(target=_pump, args=(src, stop))
        pump.start()
        try:
            yield src, dst
        finally:
            stop.set()
            pump.join(timeout=5)


def pulled(src: TransferEngine, dst: TransferEngine, region: str, ids: list[int]) -> torch.Tensor:
    """Blocks `ids` of the source's `region`, as a pull under a fresh lease brings them."""
    lease = uuid.uuid4().hex
    handle = src.handle(region, ids, lease, secret=f"s-{lease}", ttl_s=30)
    dst._regions[region].tensor.zero_()
    assert dst.pull(handle, region, ids, timeout_s=10) == len(ids) * dst._regions[region].block_nbytes
    return dst._regions[region].tensor[ids]


def test_a_deregistered_region_is_gone_and_the_others_still_move(pair: tuple[TransferEngine, TransferEngine]) -> None:
    src, dst = pair
    assert torch.equal(pulled(src, dst, "kv", [1, 4]), pattern(KV)[[1, 4]])
    assert torch.equal(pulled(src, dst, "mm", [0, 3]), pattern(MM)[[0, 3]])
    before = src.metadata()

    src.deregister("kv")

    with pytest.raises(KeyError, match="unknown region 'kv'"):
        src.handle("kv", [1], "late", secret="s", ttl_s=30)
    assert "kv" not in src._regions  # the agent no longer holds the dropped cache's tensor
    if src.transport.startswith("nixl"):
        assert src.metadata() != before  # the memory it described is no longer registered
    # The peer, which loaded the old metadata, reloads it from the next handle and reads on.
    assert torch.equal(pulled(src, dst, "mm", [2, 4]), pattern(MM)[[2, 4]])
    # The same name again (a later switch back to a language role): the new tensor's bytes.
    src.register("kv", pattern(KV_AGAIN))
    assert torch.equal(pulled(src, dst, "kv", [0, 5]), pattern(KV_AGAIN)[[0, 5]])


def test_deregistering_an_unknown_region_says_which_are_registered(
        pair: tuple[TransferEngine, TransferEngine]) -> None:
    src, _ = pair
    with pytest.raises(KeyError, match=r"unknown region 'video'; registered: \['kv', 'mm'\]"):
        src.deregister("video")
    assert sorted(src._regions) == ["kv", "mm"]
