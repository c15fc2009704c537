"""Budgets from SLOs by start-up profiling (TriInfer §4.2, Algorithm 1 lines 1-5).

An instance that must protect TTFT (E, EP, P) keeps each batch under alpha * TTFT SLO,
with alpha = 0.5 because a request needs at least two iterations to its first token (one
to encode, one to finish the prefill). An instance that decodes (D, PD, ED, EPD) keeps
each batch under the TBT SLO. Batch latency grows monotonically with batch size
(TriInfer Fig. 3), so a binary search finds the largest token budget (and image budget)
whose measured step time stays under that limit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from triptych.slo_budgets import ALPHA, latency_limit, search_budget
from triptych.topology import Stage
from triptych.worker.engine.config import DEFAULT_IMAGE_BUDGET, DEFAULT_TOKEN_BUDGET

if TYPE_CHECKING:
    from triptych.worker.engine.engine import Engine

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Budgets:
    token_budget: int | None
    image_budget: int | None
    latency_limit_s: float


def profile_budgets(engine: Engine, *, ttft_slo_s: float | None, tbt_slo_s: float | None,
                    alpha: float = ALPHA, max_token_budget: int = 8192, max_image_budget: int = 64,
                    image_size: tuple[int, int] = (448, 448)) -> Budgets:
    """Measure this engine's step times and search both budgets under the SLO limit."""
    limit = latency_limit(engine.role, ttft_slo_s, tbt_slo_s, alpha)
    tokens = images = None
    if engine.language is not None and engine.kv is not None:
        hi = min(max_token_budget, engine.kv.num_blocks * engine.kv.block_size, engine.max_model_len)
        tokens = search_budget(engine.measure_prefill, limit, 1, hi)
        if tokens < 1:
            log.warning("one token of prefill takes longer than the step limit %.4f s: the SLO cannot be "
                        "met here; running with a token budget of 1", limit)
    if engine.vision is not None and engine.role.runs(Stage.ENCODE):
        images = search_budget(lambda n: engine.measure_encode(n, image_size), limit, 1, max_image_budget)
        if images < 1:
            log.warning("encoding one %dx%d image takes longer than the step limit %.4f s: the SLO cannot be "
                        "met here; running with an image budget of 1", *image_size, limit)
    # The engine must make progress even when the SLO is out of reach.
    return Budgets(None if tokens is None else max(1, tokens), None if images is None else max(1, images), limit)


def engine_budgets(engine: Engine) -> tuple[int, int]:
    """The engine's token and image budgets: the configured ones, else (with an SLO) the
    profiled ones, else the defaults."""
    cfg = engine.config
    tokens, images = cfg.token_budget, cfg.image_budget
    if (tokens is None or images is None) and (cfg.ttft_slo_s or cfg.tbt_slo_s):
        found = profile_budgets(engine, ttft_slo_s=cfg.ttft_slo_s, tbt_slo_s=cfg.tbt_slo_s)
        tokens = tokens or found.token_budget
        images = images or found.image_budget
        log.info("budgets from SLO profiling: %s", found)
    return tokens or DEFAULT_TOKEN_BUDGET, images or DEFAULT_IMAGE_BUDGET
