"""Prefix-aware routing (routing.PrefixRouting): the prefill instance is chosen by the
longest prompt prefix it likely holds in its prefix cache, balanced against load — pure
logic over a registry, then the orchestrator against fake workers on loopback."""

from __future__ import annotations

import pytest
from fakeworkers import FakeCluster, collect, expected_tokens

from triptych.prefix_hash import block_hashes
from triptych.processor import MMItem
from triptych.router.affinity import PrefixIndex
from triptych.router.backend import GenerationRequest
from triptych.router.registry import Registry
from triptych.router.routing import Chooser, PrefixRouting, plan_request
from triptych.sampling_params import SamplingParams
from triptych.topology import InstanceType, Stage

SHARED = list(range(1, 161))  # a long system prompt: 10 blocks of 16


def _registry(*urls: str, role: InstanceType = InstanceType.EPD) -> Registry:
    reg = Registry(list(urls))
    for inst in reg.instances.values():
        inst.role, inst.ready = role, True
    return reg


def _prefill_url(reg: Registry, chooser: Chooser, index: PrefixIndex, prompt: list[int], items=(),
                 weight: float = 8.0, min_tokens: int = 16) -> tuple[str, str]:
    prefix = PrefixRouting(index, prompt, list(items), weight, min_tokens)
    plan = plan_request(reg, chooser, [it.content_hash for it in items], prefix=prefix)
    hop = next(h for h in plan.hops if Stage.PREFILL in h.stages)
    prefix.remember(hop.instance)
    return hop.instance.url, next(d.outcome for d in plan.decisions if d.stage is hop.stages[0])


def test_shared_prefix_sticks_to_its_holder_until_it_is_overloaded() -> None:
    reg, chooser, index = _registry("http://a", "http://b", "http://c"), Chooser(), PrefixIndex(1000)
    assert _prefill_url(reg, chooser, index, SHARED + [900]) == ("http://a", "chosen")  # round robin
    for i in range(5):  # round robin would go on to b, c, a, b, ...
        assert _prefill_url(reg, chooser, index, SHARED + [901 + i, 7]) == ("http://a", "prefix")
    assert _prefill_url(reg, chooser, index, [5000, 5001]) == ("http://b", "chosen")  # unrelated prompt
    reg.instances["http://a"].load = 6  # busier, but the hit (about 0.9 of 8) is worth more
    assert _prefill_url(reg, chooser, index, SHARED + [950]) == ("http://a", "prefix")
    reg.instances["http://a"].load = 12  # overloaded: a cold instance wins, and learns the prefix
    url, _ = _prefill_url(reg, chooser, index, SHARED + [951])
    assert url in ("http://b", "http://c")
    reg.instances[url].inflight = 1
    assert _prefill_url(reg, chooser, index, SHARED + [952]) == (url, "prefix")


def test_longest_prefix_wins_and_weight_zero_ignores_prefixes() -> None:
    reg, chooser, index = _registry("http://a", "http://b"), Chooser(), PrefixIndex(1000)
    index.remember(block_hashes(SHARED[:64], [], 16), "http://a")  # 4 blocks
    index.remember(block_hashes(SHARED, [], 16), "http://b")  # all 10
    assert _prefill_url(reg, chooser, index, SHARED + [1]) == ("http://b", "prefix")
    assert _prefill_url(reg, chooser, PrefixIndex(10), SHARED, weight=0.0)[1] == "chosen"
    # Only a chain counts: holding later blocks without the first is holding nothing.
    index2 = PrefixIndex(1000)
    index2.remember(block_hashes(SHARED, [], 16)[1:], "http://a")
    assert index2.matched_blocks(block_hashes(SHARED, [], 16), "http://a") == 0


def test_the_same_text_with_another_image_is_not_a_hit() -> None:
    reg, chooser, index = _registry("http://a", "http://b"), Chooser(), PrefixIndex(1000)

    def prompt(image: str) -> tuple[list[int], list[MMItem]]:
        item = MMItem(kind="image", index=0, offset=16, length=64, grid_thw=(1, 16, 16), content_hash=image,
                      width=8, height=8)
        return SHARED[:16] + [7] * 64 + SHARED[16:], [item]

    assert _prefill_url(reg, chooser, index, *prompt("x"))[0] == "http://a"
    assert _prefill_url(reg, chooser, index, *prompt("x")) == ("http://a", "prefix")
    # Another image of the same size (the same token ids): only the block before it matches.
    ids, items = prompt("y")
    assert PrefixRouting(index, ids, items, min_tokens=16).cached_share(reg.instances["http://a"]) == 16 / len(ids)
    reg.instances["http://a"].load = 1  # so a 1-block hit no longer outweighs a's load
    assert _prefill_url(reg, chooser, index, ids, items) == ("http://b", "chosen")


def test_a_short_shared_header_does_not_steer() -> None:
    reg, chooser, index = _registry("http://a", "http://b"), Chooser(), PrefixIndex(1000)
    assert _prefill_url(reg, chooser, index, SHARED[:48] + [900], min_tokens=64)[0] == "http://a"
    assert _prefill_url(reg, chooser, index, SHARED[:48] + [901], min_tokens=64) == ("http://b", "chosen")
    assert _prefill_url(reg, chooser, index, SHARED[:48] + [902], min_tokens=48) == ("http://a", "prefix")


def test_the_index_is_a_bounded_lru_and_forgets_a_failed_instance() -> None:
    index = PrefixIndex(4)
    hashes = block_hashes(SHARED, [], 16)
    index.remember(hashes[:3], "http://a")
    index.remember(hashes[:3], "http://b")
    assert index.matched_blocks(hashes, "http://a") == 3 and len(index) == 3
    index.remember(hashes[3:6], "http://a")
    assert len(index) == 4 and index.matched_blocks(hashes, "http://a") == 0  # the oldest went
    index.forget("http://a")
    assert index.matched_blocks(hashes[2:], "http://b") == 1


def _text_request(rid: str, prompt: list[int]) -> GenerationRequest:
    return GenerationRequest(rid, prompt, [], [], SamplingParams(max_tokens=3, temperature=0.0))


@pytest.mark.parametrize("topology", ["2P1D", "2EPD"])
async def test_orchestrator_sends_a_shared_prefix_to_its_holder_unless_overloaded(topology: str) -> None:
    async with FakeCluster(topology) as cluster:
        orch = cluster.orchestrator()
        first, second = sorted(n for n in cluster.workers if not n.startswith("d"))
        homes = []
        for i in range(4):
            req = _text_request(f"r{i}", SHARED + [900 + i])
            assert await collect(orch, req) == (expected_tokens(req), "length")
            homes.append(next(w.name for w in cluster.workers.values()
                              if any(r.id == req.request_id and "prefill" in r.stages for r in w.runs)))
        assert homes == [first] * 4  # round robin alone would alternate
        assert cluster.decisions("prefill", "prefix") == 3
        cluster[first].load = 50
        await cluster.registry.refresh(cluster.client)
        req = _text_request("busy", SHARED + [999])
        await collect(orch, req)
        assert any(r.id == "busy" for r in cluster[second].runs)


async def test_orchestrator_without_prefix_routing_keeps_its_policy() -> None:
    async with FakeCluster("2PD") as cluster:
        orch = cluster.orchestrator(prefix_routing=False)
        for i in range(2):
            await collect(orch, _text_request(f"r{i}", SHARED + [i]))
        assert [len(cluster[n].runs) for n in ("pd0", "pd1")] == [1, 1]
        assert cluster.decisions("prefill", "prefix") == 0
