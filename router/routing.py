"""Per-request path planning: which instance runs which stage (HydraInfer §4.4).

Rule: walk the stages E -> P -> D; keep the request on the instance that ran the previous
stage when it can run this one too (no transfer), otherwise choose among the instances
that can by the stage's policy. Images of one request may be spread over several
encode-capable instances (intra-request parallel encoding, EPDServe §3.2.2).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

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


@dataclass
class Hop:
    instance: Instance
    stages: list[Stage]


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


def stages_for(has_images: bool) -> list[Stage]:
    return list(STAGE_ORDER) if has_images else [Stage.PREFILL, Stage.DECODE]


def plan_path(registry: Registry, chooser: Chooser, stages: list[Stage],
              exclude: set[str] = frozenset()) -> list[Hop]:
    """Group the stages into hops, one per instance, following the keep-local rule."""
    hops: list[Hop] = []
    for stage in stages:
        if hops and hops[-1].instance.can_run(stage):
            hops[-1].stages.append(stage)
            continue
        hops.append(Hop(chooser.choose(stage, registry.capable(stage, exclude)), [stage]))
    return hops


def spread_images(registry: Registry, chooser: Chooser, num_images: int, first: Instance,
                  exclude: set[str] = frozenset()) -> list[Instance]:
    """Intra-request parallel encoding: image i goes to the i-th pick among E-capable instances.

    The first image stays on `first` (the hop's instance) so an EP instance keeps what it can.
    """
    picks = [first]
    for _ in range(1, num_images):
        picks.append(chooser.choose(Stage.ENCODE, registry.capable(Stage.ENCODE, exclude)))
    return picks
