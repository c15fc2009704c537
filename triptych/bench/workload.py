"""The synthetic workload of the serving benchmark: seeded multimodal chat requests (PNG
images and prompts) and their Poisson arrival times."""

from __future__ import annotations

import base64
import io
import json
import math
import random
from dataclasses import dataclass
from typing import Any

from triptych.bench.errors import BenchError

WORDS = tuple("""
the a of and to in is was for on that with as by at from this be it are an or which one all
image picture photo scene color light shadow left right top bottom center object person animal
tree house car road sky water mountain city street table chair window door red blue green
yellow black white small large bright dark near far describe explain count list compare what
where why how many several each every first second last above below behind between inside
""".split())


@dataclass(frozen=True)
class Workload:
    num_requests: int = 32
    images_per_request: int = 1
    image_size: tuple[int, int] = (64, 64)  # width, height
    prompt_len: int = 32  # words
    output_len: int = 16  # tokens (max_tokens, with ignore_eos)

    def check(self) -> None:
        w, h = self.image_size
        if self.num_requests < 1 or self.images_per_request < 0 or self.prompt_len < 1 or self.output_len < 1:
            raise BenchError("need num_requests >= 1, images_per_request >= 0, prompt_len >= 1, output_len >= 1")
        if w < 1 or h < 1:
            raise BenchError(f"image size must be positive, got {w}x{h}")


def make_prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "?"


def make_image_data_url(rng: random.Random, width: int, height: int) -> str:
    """A seeded PNG: an 8x8 grid of random colours scaled up (unique per seed, so no two
    requests share an embedding-cache entry, and small as PNG)."""
    from PIL import Image

    grid = Image.frombytes("RGB", (8, 8), rng.randbytes(8 * 8 * 3))
    buf = io.BytesIO()
    grid.resize((width, height), Image.Resampling.NEAREST).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def build_bodies(work: Workload, model: str, seed: int) -> list[bytes]:
    """The JSON bodies of the request set (built before sending, so encoding images does
    not delay arrivals)."""
    rng = random.Random(seed)
    bodies = []
    for _ in range(work.num_requests):
        parts: list[dict[str, Any]] = [
            {"type": "image_url", "image_url": {"url": make_image_data_url(rng, *work.image_size)}}
            for _ in range(work.images_per_request)]
        parts.append({"type": "text", "text": make_prompt(rng, work.prompt_len)})
        body = {"model": model, "messages": [{"role": "user", "content": parts}],
                "max_tokens": work.output_len, "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        bodies.append(json.dumps(body).encode())
    return bodies


def poisson_arrivals(rate: float, n: int, seed: int) -> list[float]:
    """Send times (s from the start) of n requests of a Poisson process at `rate`/s: the
    first at 0, then exponential gaps. `rate=inf` sends all at once."""
    if n < 0 or not rate > 0:
        raise BenchError(f"need n >= 0 and rate > 0, got n={n}, rate={rate}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    times, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        times.append(t)
    return times
