"""Hybrid instance types over real processes (router + workers, NIXL between them,
`--transfer-require nixl`): greedy completions equal transformers `generate()`, and each
request's hops went where the planner's rule says (keep a request on the instance that ran
the previous stage when it can run the next, HydraInfer §4.4), read back from every
instance's `/admin/stats` counters and transfer bytes. Also intra-request parallel encoding
(EPDServe §3.2.2) and embedding-cache affinity by image hash through 2E1P1D."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import servekit
from servekit import counter, tiny_dir

from triptych.local import LocalDeployment

pytestmark = pytest.mark.slow

FAMILIES = ["qwen2-vl", "llava"]
TOPOLOGIES = ["1EP1D", "1ED1P", "1E1PD", "2E1P1D", "1E1EP1P1D"]
NUM_CASES = 8  # 0-3 images each, half streaming: 12 images in all


@functools.cache
def _expected(family: str) -> tuple[list[servekit.Case], list[list[int]]]:
    model = tiny_dir(family)
    cases = servekit.make_cases(NUM_CASES, seed_base=20_000)
    return cases, [servekit.expected_ids(model, c) for c in cases]


@dataclass
class Served:
    family: str
    model: Path
    dep: LocalDeployment


@pytest.fixture(scope="module")
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One deployment per "family/topology" param, shared by the tests that name it."""
    family, topology = request.param.split("/")
    model = tiny_dir(family)
    with servekit.start(model, topology, tmp_path_factory.mktemp(f"{family}-{topology}")) as dep:
        yield Served(family, model, dep)


def _exact(served: Served, cases: list[servekit.Case], expected: list[list[int]]) -> None:
    bodies = [c.openai_body(served.model.name) for c in cases]
    results = asyncio.run(servekit.run_all(served.dep.router_url, bodies))
    for case, want, got in zip(cases, expected, results, strict=True):
        assert got["status"] == 200 and not got.get("error"), (case.index, got)
        assert got["finish_reason"] in ("stop", "length"), (case.index, got)
        assert got["token_ids"] == want, f"request {case.index} ({len(case.images)} images, stream={case.stream})"


@dataclass
class Observed:
    """What one batch of requests did to a deployment: per-instance counter rises (`one`:
    keyed by role, for roles with a single instance), final stats, and the expected sums."""

    dep: LocalDeployment
    stats: dict[str, dict[str, Any]]
    rise: dict[str, dict[str, int]]
    num_images: int
    prompt_tokens: int  # to compute: those not found in a prefix cache (a shared chat header)
    mm_all: int  # bytes of every image's embeddings
    kv_bytes: int  # bytes of the prefilled KV of every request that decodes past token 1

    @property
    def one(self) -> dict[str, dict[str, int]]:
        roles = [s["role"] for s in self.stats.values()]
        return {s["role"]: self.rise[n] for n, s in self.stats.items() if roles.count(s["role"]) == 1}

    def kv_pulled(self, role: str) -> int:
        """KV bytes the instances of `role` must have pulled: every hand-over's blocks but
        the leading ones their prefix cache already held (a shared chat header; counted)."""
        workers = [w for w in self.dep.workers if self.stats[w.name]["role"] == role]
        reused = sum(servekit.metric_sum(w.url, "triptych_worker_kv_blocks_reused_total") for w in workers)
        block_size = self.stats[workers[0].name]["kv_cache"]["block_size"]
        return self.kv_bytes - int(reused) * servekit.kv_block_nbytes(self.dep.model, block_size)

    def moved(self, role: str) -> int:
        """Bytes the instances of `role` pulled (embeddings and KV alike)."""
        return sum(sum(s["transfer_bytes"].values()) for s in self.stats.values() if s["role"] == role)

    def migrations(self, role: str, kind: str) -> float:
        """How many pulls of `kind` ("ep": embeddings, "pd": KV) the instances of `role` made."""
        return sum(servekit.metric_sum(w.url, "triptych_worker_migration_seconds_count", kind=kind)
                   for w in self.dep.workers if self.stats[w.name]["role"] == role)


DEPLOYMENTS = [f"{f}/{t}" for f in FAMILIES for t in TOPOLOGIES]


@pytest.mark.parametrize("served", DEPLOYMENTS, indirect=True)
def test_greedy_parity_and_hops(served: Served) -> None:
    model, dep = served.model, served.dep
    cases, expected = _expected(served.family)
    before = servekit.stats_of(dep)
    _exact(served, cases, expected)
    after = servekit.wait_idle(dep)
    servekit.assert_no_leaks(after)
    assert all(set(s["transfer_bytes"]) <= {"nixl-ucx"} for s in after.values()), after
    assert counter(after, "preemptions") == 0  # so every prompt token is prefilled exactly once
    mm_all, _ = servekit.expected_transfer_bytes(model, cases, after)
    # KV moves only for requests that go on past their first token (sampled on the P side).
    _, kv_bytes = servekit.expected_transfer_bytes(
        model, [c for c, w in zip(cases, expected, strict=True) if len(w) > 1], after)
    rise = {n: {k: v - before[n]["counters"][k] for k, v in s["counters"].items()} for n, s in after.items()}
    cached = sum(r["prefix_cache_hits"] for r in rise.values())
    obs = Observed(dep, after, rise, sum(len(c.images) for c in cases),
                   servekit.prompt_tokens(model, cases) - cached, mm_all, kv_bytes)
    assert sum(r["images_encoded"] for r in obs.rise.values()) == obs.num_images, obs.rise  # none twice
    assert sum(r["prefill_tokens"] for r in obs.rise.values()) == obs.prompt_tokens, obs.rise
    _CHECKS[frozenset(t.value for t in dep.topology)](obs)


def _check_ep_d(o: Observed) -> None:
    """EP keeps each request through prefill (no embedding moves); D only decodes, from pulled KV."""
    one = o.one
    assert one["EP"]["images_encoded"] == o.num_images and one["EP"]["prefill_tokens"] == o.prompt_tokens
    assert one["EP"]["decode_tokens"] == 0
    assert one["D"]["prefill_tokens"] == 0 and one["D"]["decode_tokens"] > 0 and one["D"]["images_encoded"] == 0
    assert o.moved("EP") == 0
    assert o.moved("D") == o.kv_pulled("D")


def _check_ed_p(o: Observed) -> None:
    """ED encodes, P prefills from pulled embeddings, the request returns to ED to decode."""
    one = o.one
    assert one["ED"]["images_encoded"] == o.num_images and one["ED"]["decode_tokens"] > 0
    assert one["ED"]["prefill_tokens"] == 0
    assert one["P"]["prefill_tokens"] == o.prompt_tokens and one["P"]["decode_tokens"] == 0
    assert o.moved("P") == o.mm_all and o.migrations("P", "pd") == 0
    assert o.moved("ED") == o.kv_pulled("ED") and o.migrations("ED", "ep") == 0


def _check_e_pd(o: Observed) -> None:
    """E encodes; PD pulls the embeddings, prefills and decodes in place: no KV ever moves."""
    one = o.one
    assert one["E"]["images_encoded"] == o.num_images
    assert one["PD"]["prefill_tokens"] == o.prompt_tokens and one["PD"]["decode_tokens"] > 0
    assert o.moved("PD") == o.mm_all
    assert o.migrations("PD", "pd") == 0 and o.migrations("PD", "ep") > 0


def _check_2e_p_d(o: Observed) -> None:
    """Two E instances share the images (round-robin plus IRP); P and D as in 1E1P1D."""
    encoders = [r for n, r in o.rise.items() if o.stats[n]["role"] == "E"]
    assert len(encoders) == 2 and all(r["images_encoded"] > 0 for r in encoders), o.rise
    one = o.one
    assert one["P"]["prefill_tokens"] == o.prompt_tokens and one["D"]["prefill_tokens"] == 0
    assert one["D"]["decode_tokens"] > 0
    assert o.moved("P") == o.mm_all
    assert o.moved("D") == o.kv_pulled("D")


def _check_mixed(o: Observed) -> None:
    """E and EP both encode (IRP spreads each 2- and 3-image request over both); EP and P
    both prefill (consecutive prefill choices alternate); what EP encoded for a request it
    prefills itself never moves; D only decodes."""
    one = o.one
    assert one["E"]["images_encoded"] > 0 and one["EP"]["images_encoded"] > 0
    assert one["E"]["prefill_tokens"] == 0
    assert one["EP"]["prefill_tokens"] > 0 and one["P"]["prefill_tokens"] > 0
    assert one["D"]["prefill_tokens"] == 0 and one["D"]["decode_tokens"] > 0
    assert one["EP"]["decode_tokens"] == 0 and one["P"]["decode_tokens"] == 0
    pulled_mm = o.moved("EP") + o.moved("P")
    assert 0 < pulled_mm < o.mm_all, (pulled_mm, o.mm_all)
    assert o.moved("D") == o.kv_pulled("D")


_CHECKS = {
    frozenset({"EP", "D"}): _check_ep_d,
    frozenset({"ED", "P"}): _check_ed_p,
    frozenset({"E", "PD"}): _check_e_pd,
    frozenset({"E", "P", "D"}): _check_2e_p_d,
    frozenset({"E", "EP", "P", "D"}): _check_mixed,
}


# --- 2E1P1D: intra-request parallel encoding and cache affinity ---------------------------

QWEN_2E = "qwen2-vl/2E1P1D"


def _images_encoded(dep: LocalDeployment) -> dict[str, int]:
    return {n: s["counters"]["images_encoded"] for n, s in servekit.stats_of(dep).items() if s["role"] == "E"}


@pytest.mark.parametrize("served", [QWEN_2E], indirect=True)
def test_parallel_encoding_spreads_one_requests_images(served: Served) -> None:
    model, dep = served.model, served.dep
    cases = [c for c in servekit.make_cases(8, seed_base=21_000) if len(c.images) == 3]
    assert len(cases) == 2
    cases[0].stream, cases[1].stream = True, False
    expected = [servekit.expected_ids(model, c) for c in cases]
    for case, want in zip(cases, expected, strict=True):  # one at a time: each alone spreads
        before = _images_encoded(dep)
        _exact(served, [case], [want])
        after = _images_encoded(dep)
        rise = {n: after[n] - before[n] for n in after}
        assert len(rise) == 2 and all(r > 0 for r in rise.values()), rise
        assert sum(rise.values()) == 3, rise
    servekit.assert_no_leaks(servekit.wait_idle(dep))


@pytest.mark.parametrize("served", [QWEN_2E], indirect=True)
def test_same_image_is_encoded_once(served: Served) -> None:
    """Round-robin alone would send consecutive single-image requests to alternate E
    instances (two encodes); affinity sends the repeat to the holder, which hits its cache."""
    model, dep = served.model, served.dep
    base = servekit.make_cases(2, seed_base=22_000)[1]  # one image
    assert len(base.images) == 1
    cases = [servekit.Case(i, base.images, prompt, 6, stream=i % 2 == 0)
             for i, prompt in enumerate(["Describe the picture.", "Hi", "What is in it?"])]
    assert len({c.pngs[0] for c in cases}) == 1  # the same bytes each time
    expected = [servekit.expected_ids(model, c) for c in cases]
    before = servekit.stats_of(dep)
    for case, want in zip(cases, expected, strict=True):
        _exact(served, [case], [want])
    after = servekit.wait_idle(dep)
    encoded = counter(after, "images_encoded", "E") - counter(before, "images_encoded", "E")
    hits = counter(after, "mm_cache_hits", "E") - counter(before, "mm_cache_hits", "E")
    assert encoded == 1, encoded
    assert hits == len(cases) - 1, hits
    servekit.assert_no_leaks(after)
