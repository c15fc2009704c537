"""Workloads: JSON-lines traces and synthetic specs.

A trace holds one request a line:
`{"t": arrival seconds, "images": [[width, height], ...], "prompt_tokens": N, "output_tokens": N}`.
`prompt_tokens` counts the text tokens only; the visual tokens follow from the images and
the model (ModelShape.tokens_per_image), so one trace serves every model.

Synthetic specs cover TriInfer's ranges (§5.1: images per request, prompt and output
lengths, Poisson rates), with long-tailed lengths as lognormals.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from triptych.error_text import short_error


class TraceRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    t: float = Field(ge=0)
    images: list[tuple[int, int]] = Field(default_factory=list)
    prompt_tokens: int = Field(ge=1)
    output_tokens: int = Field(ge=1)


class Dist(BaseModel):
    """An integer-valued distribution: fixed, uniform [low, high] or lognormal (median, sigma),
    clipped to [low, high]."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["fixed", "uniform", "lognormal"] = "fixed"
    value: int = Field(1, ge=0)
    low: int = Field(0, ge=0)
    high: int = Field(1 << 20, ge=0)
    median: float = Field(1.0, gt=0)
    sigma: float = Field(0.5, ge=0)

    @model_validator(mode="after")
    def _bounds(self) -> Dist:
        if self.low > self.high:
            raise ValueError(f"low {self.low} > high {self.high}")
        return self

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.value
        if self.kind == "uniform":
            return rng.randint(self.low, self.high)
        x = int(round(rng.lognormvariate(math.log(self.median), self.sigma)))
        return min(self.high, max(self.low, x))

    def mean(self, samples: int = 4000) -> float:
        if self.kind == "fixed":
            return float(self.value)
        if self.kind == "uniform":
            return (self.low + self.high) / 2
        rng = random.Random(12345)
        return sum(self.sample(rng) for _ in range(samples)) / samples


def fixed(n: int) -> Dist:
    return Dist(kind="fixed", value=n)


def lognormal(median: float, sigma: float, low: int = 1, high: int = 1 << 20) -> Dist:
    return Dist(kind="lognormal", median=median, sigma=sigma, low=low, high=high)


class WorkloadSpec(BaseModel):
    """Poisson arrivals at `rate` requests/s; each request draws its shape independently."""

    model_config = ConfigDict(extra="forbid")

    rate: float = Field(1.0, gt=0)
    num_requests: int = Field(200, ge=1)
    images_per_request: Dist = Field(default_factory=lambda: fixed(1))
    image_size: tuple[int, int] = (448, 448)
    prompt_tokens: Dist = Field(default_factory=lambda: fixed(64))
    output_tokens: Dist = Field(default_factory=lambda: fixed(64))
    seed: int = 0


def generate(spec: WorkloadSpec, seed: int | None = None) -> list[TraceRequest]:
    rng = random.Random(spec.seed if seed is None else seed)
    t, out = 0.0, []
    for _ in range(spec.num_requests):
        t += rng.expovariate(spec.rate)
        n_img = spec.images_per_request.sample(rng)
        out.append(TraceRequest(t=t, images=[spec.image_size] * n_img,
                                prompt_tokens=max(1, spec.prompt_tokens.sample(rng)),
                                output_tokens=max(1, spec.output_tokens.sample(rng))))
    return out


def read_trace(path: str | Path) -> list[TraceRequest]:
    reqs = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    reqs.append(TraceRequest.model_validate_json(line))
                except ValueError as exc:
                    raise ValueError(f"{path}:{n}: not a trace request: {short_error(exc)}") from None
    if not reqs:
        raise ValueError(f"{path}: empty trace")
    return sorted(reqs, key=lambda r: r.t)


def write_trace(path: str | Path, reqs: Iterable[TraceRequest]) -> None:
    with open(path, "w") as f:
        for r in reqs:
            f.write(json.dumps({"t": round(r.t, 6), "images": [list(i) for i in r.images],
                                "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens}) + "\n")


def mean_rate(reqs: Sequence[TraceRequest]) -> float:
    """Requests per second over the trace's span (n - 1 gaps between first and last)."""
    if len(reqs) < 2:
        return 1.0
    span = reqs[-1].t - reqs[0].t
    return (len(reqs) - 1) / span if span > 0 else float(len(reqs))


def at_rate(reqs: Sequence[TraceRequest], rate: float) -> list[TraceRequest]:
    """The same requests with arrival times scaled so the mean rate is `rate`: the shape of
    the trace (burstiness, request mix) is kept, only time is stretched."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    t0, scale = reqs[0].t, mean_rate(reqs) / rate
    return [r.model_copy(update={"t": (r.t - t0) * scale}) for r in reqs]


def tile(reqs: Sequence[TraceRequest], count: int) -> list[TraceRequest]:
    """At least `count` requests: the trace repeated end to end (its gaps and shapes kept,
    one mean gap between copies), so a short trace can drive a long, steady run."""
    if len(reqs) >= count:
        return list(reqs)
    t0, span = reqs[0].t, reqs[-1].t - reqs[0].t
    period = span + (span / (len(reqs) - 1) if len(reqs) > 1 else 1.0)
    out: list[TraceRequest] = []
    copy = 0
    while len(out) < count:
        out += [r.model_copy(update={"t": r.t - t0 + copy * period}) for r in reqs]
        copy += 1
    return out[:count]


def resample(reqs: Sequence[TraceRequest], seed: int, count: int | None = None) -> list[TraceRequest]:
    """A bootstrap replica: request shapes and inter-arrival gaps drawn with replacement
    from the trace (another realization of the same workload, for variance reduction)."""
    rng = random.Random(seed)
    gaps = [b.t - a.t for a, b in zip(reqs, reqs[1:], strict=False)] or [1.0]
    t, out = 0.0, []
    for _ in range(count or len(reqs)):
        r = rng.choice(reqs)
        out.append(r.model_copy(update={"t": t}))
        t += rng.choice(gaps)
    return out


class WorkloadStats(BaseModel):
    """The shape of a workload, as the optimizer and the signals see it."""

    rate: float
    images_per_request: float
    image_pixels: float  # mean pixels per image
    prompt_tokens: float
    output_tokens: float
    num_requests: int


def stats(reqs: Sequence[TraceRequest]) -> WorkloadStats:
    n = len(reqs)
    imgs = [i for r in reqs for i in r.images]
    return WorkloadStats(
        rate=mean_rate(reqs), images_per_request=len(imgs) / n,
        image_pixels=sum(w * h for w, h in imgs) / len(imgs) if imgs else 0.0,
        prompt_tokens=sum(r.prompt_tokens for r in reqs) / n,
        output_tokens=sum(r.output_tokens for r in reqs) / n, num_requests=n)
