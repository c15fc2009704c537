"""Step-time tables: what one engine step costs, by what it holds.

A profile is measured on the device (`triptych profile`, worker/step_profile.py) or built by
the roofline model (roofline.py). Tables, all in seconds:

- encode[pixels per image] -> points (images in the batch, seconds);
- prefill: points (tokens in the chunk, seconds), context 0;
- decode: rows (batch size, context length, seconds);
- migration: bytes -> latency + bytes / bandwidth.

Lookups interpolate linearly between points and extrapolate linearly past the last one
(step time grows about linearly with batch size once the device is saturated, TriInfer
Fig. 3). A mixed step runs encode, then the language forward over prefill tokens plus one
token per decode (as worker/engine/engine.py's step does); the decodes' attention over
their context is added from the decode table.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from triptych.operator.planner.model_shape import ModelShape
from triptych.slo_budgets import search_budget


class Point(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    x: float
    seconds: float = Field(ge=0)


class EncodeRow(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    pixels: int = Field(ge=1, description="pixels per image (width * height)")
    points: list[Point] = Field(min_length=1, description="x: images in the batch")


class DecodeRow(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    context: int = Field(ge=0, description="context length of each decoding request")
    points: list[Point] = Field(min_length=1, description="x: decodes in the batch")


class Migration(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    latency_s: float = Field(0.0, ge=0)
    bytes_per_s: float = Field(gt=0)

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bytes_per_s


class StepProfile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source: str = Field(description="'measured:<device>' or 'roofline:<gpu>'")
    shape: ModelShape
    dtype_bytes: int = 2
    encode: list[EncodeRow] = Field(min_length=1)
    prefill: list[Point] = Field(min_length=1)
    decode: list[DecodeRow] = Field(min_length=1)
    migration: Migration
    step_overhead_s: float = Field(0.0, ge=0, description="fixed cost of any step (scheduling, launch)")
    decode_token_overhead_s: float = Field(0.0, ge=0, description="cost per decoding request per step beyond "
                                           "the forward (handing its token out: output processing, streaming)")
    kv_capacity_tokens: int = Field(ge=1, description="KV cache tokens one instance holds")
    max_num_seqs: int = Field(256, ge=1)

    # --- persistence --------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.model_dump_json(indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> StepProfile:
        return cls.model_validate_json(Path(path).read_text())

    # --- lookups ------------------------------------------------------------------------
    def encode_s(self, num_images: int, pixels: float) -> float:
        if num_images <= 0:
            return 0.0
        keys, curves = self._encode_curves
        i = bisect.bisect_left(keys, pixels)
        if i == 0 or len(keys) == 1:  # outside the table: scale the nearest row by the pixel ratio
            return _interp(curves[0], num_images) * pixels / keys[0]
        if i == len(keys):
            return _interp(curves[-1], num_images) * pixels / keys[-1]
        a, b = _interp(curves[i - 1], num_images), _interp(curves[i], num_images)
        return a + (b - a) * (pixels - keys[i - 1]) / (keys[i] - keys[i - 1])

    def prefill_s(self, num_tokens: int) -> float:
        return _interp(self._prefill_curve, num_tokens) if num_tokens > 0 else 0.0

    def decode_s(self, batch: int, context: float) -> float:
        if batch <= 0:
            return 0.0
        keys, curves = self._decode_curves
        i = bisect.bisect_left(keys, context)
        if i == 0 or len(keys) == 1:
            return _interp(curves[0], batch)
        if i == len(keys):  # past the last context: extrapolate from the last two rows
            i = len(keys) - 1
        a, b = _interp(curves[i - 1], batch), _interp(curves[i], batch)
        return max(0.0, a + (b - a) * (context - keys[i - 1]) / (keys[i] - keys[i - 1]))

    def step_s(self, *, images: int = 0, pixels: float = 0.0, prefill_tokens: int = 0,
               decodes: int = 0, context: float = 0.0) -> float:
        """One scheduler step: encode the images, then one language forward."""
        t = self.step_overhead_s + self.encode_s(images, pixels)
        t += decodes * self.decode_token_overhead_s
        if prefill_tokens and decodes:
            base = self._decode_curves[0][0]
            attn = max(0.0, self.decode_s(decodes, context) - self.decode_s(decodes, base))
            t += self.prefill_s(prefill_tokens + decodes) + attn
        elif prefill_tokens:
            t += self.prefill_s(prefill_tokens)
        elif decodes:
            t += self.decode_s(decodes, context)
        return t

    def migration_s(self, nbytes: float) -> float:
        return self.migration.seconds(nbytes) if nbytes > 0 else 0.0

    # --- TriInfer Alg. 1 lines 1-5: budgets from the SLO ----------------------------------
    def token_budget(self, limit_s: float, hi: int = 16384) -> int:
        return max(1, search_budget(lambda n: self.step_overhead_s + self.prefill_s(n), limit_s, 1, hi))

    def image_budget(self, limit_s: float, pixels: float, hi: int = 256) -> int:
        return max(1, search_budget(lambda n: self.step_overhead_s + self.encode_s(n, pixels), limit_s, 1, hi))

    @cached_property
    def _encode_curves(self) -> tuple[list[int], list[_Curve]]:
        rows = sorted(self.encode, key=lambda r: r.pixels)
        return [r.pixels for r in rows], [_curve(r.points) for r in rows]

    @cached_property
    def _prefill_curve(self) -> _Curve:
        return _curve(self.prefill)

    @cached_property
    def _decode_curves(self) -> tuple[list[int], list[_Curve]]:
        rows = sorted(self.decode, key=lambda r: r.context)
        return [r.context for r in rows], [_curve(r.points) for r in rows]


_Curve = tuple[list[float], list[float]]


def _curve(points: Sequence[Point]) -> _Curve:
    pts = sorted(points, key=lambda p: p.x)
    return [p.x for p in pts], [p.seconds for p in pts]


def _interp(curve: _Curve, x: float) -> float:
    """Linear between points, linear extrapolation past the last, proportional below the first."""
    xs, ys = curve
    if len(xs) == 1:
        return ys[0] * x / xs[0] if xs[0] else ys[0]
    if x <= xs[0]:
        return ys[0] * x / xs[0] if xs[0] > 0 else ys[0]
    i = bisect.bisect_left(xs, x)
    if i >= len(xs):
        i = len(xs) - 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    if x1 == x0:
        return y1
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))
