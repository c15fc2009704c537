"""Per-request path planning: which instance runs which stage (HydraInfer §4.4).

Rule: walk the stages E -> P -> D; keep the request on the instance that ran the previous
stage when it can run this one too (no transfer), otherwise choose among the instances
that can by the stage's policy. Images of one request may be spread over several
encode-capable instances (intra-request parallel encoding, EPDServe §3.2.2), and an image
goes where its embedding is likely cached (affinity.py). The instance that prefills (or
runs the request whole) is chosen by the longest cached prompt prefix, balanced against
load (`PrefixRouting`, as llm-d's and Dynamo's KV-aware routers do), when one likely
holds a prefix of it.

`plan_request` returns the final `Plan`: the encode-only runs to do first, then the hops
in order, each saying which images it encodes itself. Plans are immutable; the
orchestrator carries one out as it is.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from triptych.prefix_hash import BlockHash, block_hashes
from triptych.router.affinity import AffinityIndex, PrefixIndex
from triptych.router.registry import Instance, Registry
from triptych.topology import STAGE_ORDER, Stage


class Policy(StrEnum):
    ROUND_ROBIN = "round-robin"
    LEAST_LOADED = "least-loaded"
    POWER_OF_TWO = "power-of-two"


class NoInstanceError(RuntimeError):
    """No ready instance can run a stage the request needs."""

    def __init__(self, stage: Stage) -> None:
        super().__init__(f"no ready instance can run the {stage.value} stage")
        self.stage = stage


AFFINITY_POLICY = "cache-affinity"  # the policy label of an image placed by affinity
PREFIX_POLICY = "prefix-aware"  # the policy label of a prefill placed by its cached prefix


@dataclass(frozen=True)
class Hop:
    """One run of contiguous stages of the request on one instance."""

    instance: Instance
    stages: tuple[Stage, ...]
    images: tuple[str, ...] = ()  # content hashes this hop encodes itself (with ENCODE in stages)
    by_prefix: bool = False  # placed by PrefixRouting (a cached prompt prefix), not by policy


@dataclass(frozen=True)
class EncodeRun:
    """Encode-only work done before the hops, on an instance other than the one that
    prefills; the prefill hop pulls the embeddings it hands over."""

    instance: Instance
    images: tuple[str, ...]  # content hashes, in prompt order


@dataclass(frozen=True)
class Decision:
    """One routing choice, for `triptych_frontend_routing_decisions_total`."""

    stage: Stage
    policy: str
    outcome: str  # chosen, kept_local, affinity


@dataclass(frozen=True)
class Plan:
    encodes: tuple[EncodeRun, ...]  # run concurrently, first
    hops: tuple[Hop, ...]  # then in order; the last one decodes
    placement: tuple[tuple[str, str], ...] = ()  # (content hash, URL of the instance encoding it)
    decisions: tuple[Decision, ...] = ()
    # V instances that decode the request's videos (FlashCodec, paper 000 §3: one video's
    # GOP sets spread over all of them); empty: the encoding instance decodes them itself.
    decoders: tuple[Instance, ...] = ()
    # Content hashes placed by cache affinity: on an instance whose MM cache likely holds
    # their embedding. A video among them is not decoded on the V instances (only its
    # bytes go, in case the embedding was evicted: the encoding instance then decodes).
    cached: tuple[str, ...] = ()


@dataclass
class Chooser:
    """Picks one instance among candidates by the stage's policy (`policy` unless
    `per_stage` overrides it); round-robin keeps a cursor per stage."""

    policy: Policy = Policy.ROUND_ROBIN
    per_stage: dict[Stage, Policy] = field(default_factory=dict)
    rng: random.Random = field(default_factory=random.Random)
    _cursors: dict[Stage, itertools.count] = field(default_factory=dict)

    def policy_for(self, stage: Stage) -> Policy:
        return self.per_stage.get(stage, self.policy)

    def choose(self, stage: Stage, candidates: Sequence[Instance]) -> Instance:
        if not candidates:
            raise NoInstanceError(stage)
        ordered = sorted(candidates, key=lambda i: i.url)
        policy = self.policy_for(stage)
        if policy is Policy.LEAST_LOADED:
            return min(ordered, key=_pressure)
        if policy is Policy.POWER_OF_TWO and len(ordered) > 1:
            a, b = self.rng.sample(ordered, 2)
            return a if _pressure(a) <= _pressure(b) else b
        cursor = self._cursors.setdefault(stage, itertools.count())
        return ordered[next(cursor) % len(ordered)]


def parse_stage_policies(specs: Sequence[str]) -> dict[Stage, Policy]:
    """`["encode=least-loaded", "decode=power-of-two"]` -> {Stage.ENCODE: ..., ...}."""
    out: dict[Stage, Policy] = {}
    for spec in specs:
        stage, sep, policy = spec.partition("=")
        try:
            if not sep:
                raise ValueError(spec)
            out[Stage(stage.strip())] = Policy(policy.strip())
        except ValueError:
            raise ValueError(f"bad stage policy {spec!r}; expected STAGE=POLICY with STAGE in "
                             f"{', '.join(s.value for s in Stage)} and POLICY in "
                             f"{', '.join(p.value for p in Policy)}") from None
    return out


def _pressure(inst: Instance) -> tuple[float, int]:
    return (inst.load + inst.inflight, inst.inflight)


@dataclass
class PrefixRouting:
    """Prefix-aware choice of the instance that prefills one request (llm-d's
    prefix-cache + load scorers; Dynamo's KV router cost `overlap weight x blocks to
    prefill + load`). Each candidate costs

        weight x (share of the prompt it would prefill) + its load (requests queued and in flight)

    and the cheapest wins; ties go to the stage's policy. With no candidate known to hold
    any of the prompt's blocks, the policy chooses alone. `weight` is how many queued
    requests a whole-prompt hit is worth: 0 turns prefix routing off, a large one sends
    every request to the holder however loaded it is. A hit shorter than `min_tokens`
    counts as none: a chat template's shared header would otherwise pull every request
    to one instance for a saving of a block or two.

    The prompt's block hashes are the workers' chain (`triptych.prefix_hash`) at each
    instance's reported block size."""

    index: PrefixIndex
    token_ids: Sequence[int]
    mm_items: Sequence[Any]
    weight: float = 8.0
    min_tokens: int = 64
    _hashes: dict[int, list[BlockHash]] = field(default_factory=dict)

    def hashes(self, block_size: int) -> list[BlockHash]:
        if block_size not in self._hashes:
            self._hashes[block_size] = block_hashes(self.token_ids, self.mm_items, block_size)
        return self._hashes[block_size]

    def cached_share(self, inst: Instance) -> float:
        """The share of the prompt `inst` likely holds in its prefix cache."""
        tokens = self.index.matched_blocks(self.hashes(inst.block_size), inst.url) * inst.block_size
        return 0.0 if tokens < self.min_tokens else min(1.0, tokens / max(1, len(self.token_ids)))

    def choose(self, chooser: Chooser, stage: Stage, candidates: Sequence[Instance]) -> tuple[Instance, bool]:
        """The instance, and whether its cached prefix decided it."""
        if not candidates:
            raise NoInstanceError(stage)
        shares = {inst.url: self.cached_share(inst) for inst in candidates}
        if self.weight <= 0 or not any(shares.values()):
            return chooser.choose(stage, candidates), False
        cost = {inst.url: self.weight * (1 - shares[inst.url]) + _pressure(inst)[0] for inst in candidates}
        best = min(cost.values())
        tied = [inst for inst in candidates if cost[inst.url] == best]
        inst = tied[0] if len(tied) == 1 else chooser.choose(stage, tied)  # a lone winner leaves the cursor be
        return inst, shares[inst.url] > 0

    def remember(self, inst: Instance) -> None:
        """`inst` prefills the prompt: from now on it likely holds its full blocks."""
        self.index.remember(self.hashes(inst.block_size), inst.url)


def stages_for(has_images: bool) -> list[Stage]:
    return list(STAGE_ORDER) if has_images else [Stage.PREFILL, Stage.DECODE]


def plan_path(registry: Registry, chooser: Chooser, stages: Sequence[Stage],
              exclude: set[str] | frozenset[str] = frozenset(), prefix: PrefixRouting | None = None
              ) -> list[Hop]:
    """Group the stages into hops, one per instance, following the keep-local rule. With
    `prefix`, the instance that will prefill is chosen by its cached prompt prefix."""
    groups: list[tuple[Instance, list[Stage], bool]] = []
    for stage in stages:
        if groups and groups[-1][0].can_run(stage):
            groups[-1][1].append(stage)
            continue
        candidates = registry.capable(stage, exclude)
        if prefix is not None and _will_prefill(stage, candidates):
            inst, by_prefix = prefix.choose(chooser, stage, candidates)
        else:
            inst, by_prefix = chooser.choose(stage, candidates), False
        groups.append((inst, [stage], by_prefix))
    return [Hop(inst, tuple(group), by_prefix=by_prefix) for inst, group, by_prefix in groups]


def _will_prefill(stage: Stage, candidates: Sequence[Instance]) -> bool:
    """The chosen instance prefills: the prefill stage itself, or an encode whose every
    candidate also prefills (keep-local then runs the prefill there too)."""
    if stage is Stage.PREFILL:
        return True
    return stage is Stage.ENCODE and bool(candidates) and all(c.can_run(Stage.PREFILL) for c in candidates)


def plan_request(registry: Registry, chooser: Chooser, image_hashes: Sequence[str],
                 exclude: set[str] | frozenset[str] = frozenset(), *, parallel_encode: bool = True,
                 affinity: AffinityIndex | None = None, prefix: PrefixRouting | None = None) -> Plan:
    """The whole path of one request: hops by the keep-local rule (the prefill's instance
    by cached prefix, with `prefix`), then where each distinct image is encoded (IRP
    spread, then affinity, which wins). Raises NoInstanceError."""
    hashes = list(dict.fromkeys(image_hashes))
    path = plan_path(registry, chooser, stages_for(bool(hashes)), exclude, prefix)
    decisions = [_decision(chooser, hop, i, stage) for hop in path for i, stage in enumerate(hop.stages)]
    if not hashes:
        return Plan((), tuple(path), (), tuple(decisions))
    if parallel_encode and len(hashes) > 1:
        picks = spread_images(registry, chooser, len(hashes), path[0].instance, exclude)
    else:
        picks = [path[0].instance] * len(hashes)
    if affinity is not None:
        held = [affinity.holder(h, registry, exclude) for h in hashes]
        decisions += [Decision(Stage.ENCODE, AFFINITY_POLICY, "affinity") for h in held if h is not None]
        picks = [h or p for h, p in zip(held, picks, strict=True)]
        cached = tuple(h for h, inst in zip(hashes, held, strict=True) if inst is not None)
    else:
        cached = ()
    placement = list(zip(hashes, picks, strict=True))
    encodes, hops = _encode_where_placed(path, placement)
    return Plan(encodes, hops, tuple((h, inst.url) for h, inst in placement), tuple(decisions), cached=cached)


def _decision(chooser: Chooser, hop: Hop, i: int, stage: Stage) -> Decision:
    if i > 0:
        return Decision(stage, chooser.policy_for(stage).value, "kept_local")
    if hop.by_prefix:
        return Decision(stage, PREFIX_POLICY, "prefix")
    return Decision(stage, chooser.policy_for(stage).value, "chosen")


def _encode_where_placed(path: list[Hop], placement: list[tuple[str, Instance]]
                         ) -> tuple[tuple[EncodeRun, ...], tuple[Hop, ...]]:
    """Turn the images' placement into work: the instance that prefills encodes its images
    in its own hop (an encode-only run there would hand embeddings to itself under the same
    id); every other instance gets one encode-only run. An E-only first hop is replaced by
    those runs."""
    hops = path[1:] if path[0].stages == (Stage.ENCODE,) else path
    at = next(i for i, hop in enumerate(hops) if Stage.PREFILL in hop.stages)
    prefill = hops[at]
    local = tuple(h for h, inst in placement if inst is prefill.instance)
    stages = (Stage.ENCODE, *prefill.stages) if local and Stage.ENCODE not in prefill.stages else prefill.stages
    remote: dict[str, tuple[Instance, list[str]]] = {}
    for h, inst in placement:
        if inst is not prefill.instance:
            remote.setdefault(inst.url, (inst, []))[1].append(h)
    encodes = tuple(EncodeRun(inst, tuple(hs)) for inst, hs in remote.values())
    return encodes, (*hops[:at], Hop(prefill.instance, stages, local, prefill.by_prefix), *hops[at + 1:])


def spread_images(registry: Registry, chooser: Chooser, num_images: int, first: Instance,
                  exclude: set[str] | frozenset[str] = frozenset()) -> list[Instance]:
    """Intra-request parallel encoding: image i goes to the i-th pick among E-capable instances.

    The first image stays on `first` (the hop's instance) so an EP instance keeps what it can.
    """
    picks = [first]
    for _ in range(1, num_images):
        picks.append(chooser.choose(Stage.ENCODE, registry.capable(Stage.ENCODE, exclude)))
    return picks
