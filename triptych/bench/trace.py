"""`bench serve --trace FILE`: replay a JSON-lines trace (operator/planner/workload.py's
format: `{"t", "images": [[w, h], ...], "prompt_tokens", "output_tokens"}`) against a live
deployment. Arrival times are the trace's (or the trace re-timed to a mean rate, its shape
kept), images are seeded PNGs of the trace's sizes, each prompt has about
`prompt_tokens` text tokens and `max_tokens = output_tokens` with `ignore_eos`.

Words and tokens differ by model, so the prompt length is calibrated against the served
model first: two text-only requests of known word counts, their `usage.prompt_tokens`
give tokens per word and the chat template's overhead. A client: no torch."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from triptych.bench.errors import BenchError
from triptych.bench.workload import make_image_data_url, make_prompt
from triptych.operator.planner.workload import TraceRequest, at_rate, mean_rate, read_trace

CALIBRATION_WORDS = (20, 120)


@dataclass(frozen=True)
class PromptScale:
    """Text tokens per prompt word of the served model, and the tokens its chat template
    adds to a text-only prompt (so a trace's `prompt_tokens` can be hit within a word)."""

    tokens_per_word: float = 1.0
    template_tokens: int = 0

    def words_for(self, tokens: int) -> int:
        return max(1, round(tokens / self.tokens_per_word))


def load_trace(path: str) -> list[TraceRequest]:
    try:
        return read_trace(path)
    except (OSError, ValueError) as exc:
        raise BenchError(f"--trace {path}: {exc}") from exc


def timed(trace: Sequence[TraceRequest], rate: float | None) -> list[TraceRequest]:
    """The trace from t = 0, re-timed to mean `rate` when given."""
    reqs = at_rate(trace, rate) if rate is not None else list(trace)
    t0 = reqs[0].t
    return [r.model_copy(update={"t": r.t - t0}) for r in reqs]


def trace_rate(trace: Sequence[TraceRequest]) -> float:
    return mean_rate(trace)


def trace_bodies(trace: Sequence[TraceRequest], model: str, seed: int, scale: PromptScale) -> list[bytes]:
    """One streaming chat body per trace request (built before sending, as build_bodies)."""
    rng = random.Random(seed)
    bodies = []
    for req in trace:
        parts: list[dict[str, Any]] = [
            {"type": "image_url", "image_url": {"url": make_image_data_url(rng, w, h)}} for w, h in req.images]
        parts.append({"type": "text", "text": make_prompt(rng, scale.words_for(req.prompt_tokens))})
        body = {"model": model, "messages": [{"role": "user", "content": parts}],
                "max_tokens": req.output_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        bodies.append(json.dumps(body).encode())
    return bodies


async def _prompt_tokens(client: httpx.AsyncClient, url: str, model: str, words: int,
                         headers: dict[str, str]) -> int:
    text = make_prompt(random.Random(words), words)
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1, "temperature": 0.0}
    try:
        resp = await client.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60.0)
        resp.raise_for_status()
        return int(resp.json()["usage"]["prompt_tokens"])
    except (httpx.HTTPError, KeyError, TypeError, ValueError) as exc:
        raise BenchError(f"prompt calibration request failed: {exc}") from exc


async def calibrate(client: httpx.AsyncClient, url: str, model: str, headers: dict[str, str]) -> PromptScale:
    """Tokens per word (the slope between two prompt lengths, where make_prompt's closing
    '?' cancels out) and the template's tokens (the rest)."""
    lo, hi = CALIBRATION_WORDS
    n_lo = await _prompt_tokens(client, url, model, lo, headers)
    n_hi = await _prompt_tokens(client, url, model, hi, headers)
    per_word = (n_hi - n_lo) / (hi - lo)
    if per_word <= 0:
        raise BenchError(f"prompt calibration: {lo} words gave {n_lo} tokens, {hi} gave {n_hi}")
    return PromptScale(tokens_per_word=per_word, template_tokens=max(0, round(n_lo - per_word * lo)))
