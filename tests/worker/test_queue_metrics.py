"""The worker's per-stage queue gauges (`triptych_worker_queued_*{stage}`) as /metrics
writes them, read back by the planner's scrape path into one snapshot."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from engine_cases import Item
from prometheus_client import CollectorRegistry, generate_latest

from triptych.operator.planner.signals import parse_metrics, snapshot_from_scrapes
from triptych.topology import InstanceType, Stage
from triptych.worker.engine.kv_cache import KVCache
from triptych.worker.engine.mm_cache import MMCache
from triptych.worker.engine.request import Request
from triptych.worker.engine.scheduler import QueuedWork, Scheduler, SchedulerConfig
from triptych.worker.metrics import InstanceCollector


class FakeEngine:
    """The two engine calls the collector makes, over a real scheduler."""

    def __init__(self, role: InstanceType, scheduler: Scheduler) -> None:
        self.role, self.scheduler = role, scheduler

    def stats(self) -> dict:
        out = {"num_waiting": len(self.scheduler.waiting), "num_running": len(self.scheduler.running),
               "num_parked": 0, "max_num_seqs": self.scheduler.config.max_num_seqs,
               "counters": self.scheduler.counters.as_dict()}
        if self.scheduler.kv is not None:
            out["kv_cache"] = {"used": self.scheduler.kv.num_used, "free": self.scheduler.kv.num_free}
        return out

    def queued_work(self) -> dict[Stage, QueuedWork]:
        return self.scheduler.queued_work()


def exposition(instance_id: str, role: InstanceType, requests: list[Request]) -> str:
    kv = KVCache(num_blocks=64, num_layers=1, num_kv_heads=1, head_dim=2, block_size=4,
                 dtype=torch.float32, device="cpu") if role.needs_language else None
    mm = MMCache(num_blocks=64, rows_per_block=4, hidden_size=2, dtype=torch.float32, device="cpu")
    sched = Scheduler(SchedulerConfig(64, 4, 8), kv, mm)
    for r in requests:
        sched.add(r)
    inst = SimpleNamespace(settings=SimpleNamespace(instance_id=instance_id), role=role.value,
                           engine=FakeEngine(role, sched), leases_outstanding=lambda: 0)
    reg = CollectorRegistry()
    reg.register(InstanceCollector(inst))  # type: ignore[arg-type]
    return generate_latest(reg).decode()


def req(rid: str, n: int, hashes: list[str], stages: set[Stage]) -> Request:
    items = [Item(1 + 5 * i, 4, h) for i, h in enumerate(hashes)]
    return Request(rid, list(range(n)), mm_items=items, images={h: b"x" for h in hashes},
                   stages=frozenset(stages))


def test_worker_queue_gauges_feed_the_planner_snapshot() -> None:
    e0 = exposition("e0", InstanceType("E"), [req("a", 20, ["h1", "h2"], {Stage.ENCODE}),
                                               req("b", 12, ["h3"], {Stage.ENCODE})])
    e1 = exposition("e1", InstanceType("E"), [req("c", 12, ["h4"], {Stage.ENCODE})])
    pd = exposition("pd0", InstanceType("PD"), [req("d", 30, [], {Stage.PREFILL, Stage.DECODE}),
                                                 req("e", 7, [], {Stage.PREFILL, Stage.DECODE})])
    assert 'triptych_worker_queued_images{instance="e0",role="E",stage="encode"} 3.0' in e0
    assert 'stage="prefill"' not in e0  # only the stages the role runs
    assert 'triptych_worker_queued_tokens{instance="pd0",role="PD",stage="prefill"} 37.0' in pd
    assert 'triptych_worker_queued_requests{instance="pd0",role="PD",stage="decode"} 0.0' in pd
    snap = snapshot_from_scrapes(None, parse_metrics([e0, e1, pd]), None, now=1.0)
    q = snap.queues
    assert (q["encode"].requests, q["encode"].images) == (3.0, 4.0)  # summed over e0 and e1
    assert (q["prefill"].requests, q["prefill"].tokens, q["decode"].requests) == (2.0, 37.0, 0.0)
    # decode pressure: seats and KV of the decoding instance only (pd0: max_num_seqs 8, 64 blocks)
    assert 'triptych_worker_max_num_seqs{instance="pd0",role="PD"} 8.0' in pd
    assert (snap.decode.seats, snap.decode.running, snap.decode.kv_total_blocks) == (8.0, 0.0, 64.0)
