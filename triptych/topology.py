"""Instance types, roles and the topology grammar shared by CLI, router, worker and operator.

An instance type names the stages an instance runs (HydraInfer §4.4): E (encode),
P (prefill), D (decode) and the hybrids EP, ED, PD, EPD; and V, the video decoder
(FlashCodec, paper 000 §3), which runs none of them and loads no model weights: it decodes
GOP-aligned segments of videos for the encode instances. The same tokens are used by
`triptych serve --topology`, the worker `--role`, the pod label `triptych.dev/role` and
the CRD's `spec.topology` keys.
"""

from __future__ import annotations

import re
from enum import StrEnum


class Stage(StrEnum):
    ENCODE = "encode"
    PREFILL = "prefill"
    DECODE = "decode"


STAGE_ORDER: tuple[Stage, ...] = (Stage.ENCODE, Stage.PREFILL, Stage.DECODE)
_STAGE_LETTER = {"E": Stage.ENCODE, "P": Stage.PREFILL, "D": Stage.DECODE}


class InstanceType(StrEnum):
    E = "E"
    P = "P"
    D = "D"
    EP = "EP"
    ED = "ED"
    PD = "PD"
    EPD = "EPD"
    V = "V"  # video decode only: no E/P/D stage, no model weights

    @property
    def stages(self) -> frozenset[Stage]:
        # Looked up, not rebuilt: the router asks this several times per request it plans.
        return _TYPE_STAGES[self]

    @property
    def decodes_video(self) -> bool:
        return self is InstanceType.V

    def runs(self, stage: Stage) -> bool:
        return stage in self.stages

    @property
    def needs_vision(self) -> bool:
        return Stage.ENCODE in self.stages

    @property
    def needs_language(self) -> bool:
        return bool(self.stages & {Stage.PREFILL, Stage.DECODE})


_TYPE_STAGES: dict[str, frozenset[Stage]] = {
    t: frozenset(_STAGE_LETTER[c] for c in t.value if c in _STAGE_LETTER) for t in InstanceType}

# The instance types that run E/P/D stages (a role switch moves between these; V is its own pool).
STAGE_TYPES: tuple[InstanceType, ...] = tuple(t for t in InstanceType if t.stages)
UNASSIGNED = "unassigned"
ROLE_CHOICES: tuple[str, ...] = (*(t.value for t in InstanceType), UNASSIGNED)

# Longest type first so "EPD" is read as one aggregated instance, not E + PD.
_TYPES_LONGEST_FIRST = sorted((t.value for t in InstanceType), key=len, reverse=True)
_TOKEN = re.compile(r"(\d*)(" + "|".join(_TYPES_LONGEST_FIRST) + r")")


class TopologyError(ValueError):
    """A topology spec that does not parse or names no instance."""


def parse_topology(spec: str) -> dict[InstanceType, int]:
    """Parse `[count]TYPE...` (e.g. `1E1P2D`, `EPD`, `2EP1D`) into counts per type."""
    text = spec.strip().upper()
    if not text:
        raise TopologyError("empty topology; expected e.g. 'EPD' or '1E1P1D'")
    counts: dict[InstanceType, int] = {}
    pos = 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            raise TopologyError(
                f"cannot parse topology {spec!r} at {text[pos:]!r}; "
                f"tokens are [count]TYPE with TYPE in {', '.join(_TYPES_LONGEST_FIRST)}"
            )
        count = int(match.group(1)) if match.group(1) else 1
        kind = InstanceType(match.group(2))
        counts[kind] = counts.get(kind, 0) + count
        pos = match.end()
    counts = {k: v for k, v in counts.items() if v > 0}
    if not counts:
        raise TopologyError(f"topology {spec!r} has no instances")
    validate_coverage(counts)
    return counts


def validate_coverage(counts: dict[InstanceType, int]) -> None:
    """Every request needs prefill and decode somewhere. Encode is needed only for images:
    a deployment without it serves text (image requests then get a 503 naming the stage).
    V instances only help an encode instance: V without any encode-capable type is refused."""
    stages = set().union(*(t.stages for t, n in counts.items() if n > 0)) if counts else set()
    missing = [s.value for s in (Stage.PREFILL, Stage.DECODE) if s not in stages]
    if missing:
        raise TopologyError(f"topology runs no instance for stage(s): {', '.join(missing)}")
    if counts.get(InstanceType.V) and Stage.ENCODE not in stages:
        raise TopologyError("V instances decode video for an encode instance; the topology has none")


def format_topology(counts: dict[InstanceType, int]) -> str:
    order = [InstanceType(t) for t in ("V", "E", "EP", "ED", "EPD", "P", "PD", "D")]
    return "".join(f"{counts[t]}{t.value}" for t in order if counts.get(t))
