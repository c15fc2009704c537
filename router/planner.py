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
    """Picks one instance among candidates by a policy; round-robin keeps a cursor per stage."""

    policy: Policy = Policy.ROUND_ROBIN
    rng: random.Random = field(default_factory=random.Random)
    _cursors: dict[Stage, itertools.count] = field(default_factory=dict)

    def choose(self, stage: Stage, candidates: Sequence[Instance]) -> Instance:
        if not candidates:
            raise NoInstanceError(stage)
        ordered = sorted(candidates, key=lambda i: i.url)
        if self.policy is Policy.LEAST_LOADED:
            return min(ordered, key=_pressure)
        if self.policy is Policy.POWER_OF_TWO and len(ordered) > 1:
            a, b = self.rng.sample(ordered, 2)
            return a if _pressure(a) <= _pressure(b) else b
        cursor = self._cursors.setdefault(stage, itertools.count())
        return ordered[next(cursor) % len(ordered)]


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
