"""Opt-in: exact greedy parity on a real local checkpoint (`TRIPTYCH_REAL_MODEL=DIR`), through
the same loader, processor and engine as the tiny models. Nothing is downloaded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from engine_cases import make_cases, processor, to_request
from hf_reference import hf_generate

from triptych.sampling_params import SamplingParams
from triptych.worker.engine import Engine, EngineConfig

REAL = os.environ.get("TRIPTYCH_REAL_MODEL")
pytestmark = pytest.mark.skipif(not REAL, reason="set TRIPTYCH_REAL_MODEL to a local checkpoint directory")


def test_real_checkpoint_greedy_parity() -> None:
    model = Path(REAL or "")
    proc = processor(model)
    cases = make_cases(4)
    engine = Engine(EngineConfig(model=str(model), dtype=os.environ.get("TRIPTYCH_REAL_DTYPE", "float32"),
                                 device="cuda" if os.environ.get("TRIPTYCH_REAL_DEVICE") == "cuda" else "cpu",
                                 kv_cache_bytes=1 << 30))
    params = SamplingParams(temperature=0.0, max_tokens=8)
    reqs = engine.generate_batch([to_request(proc, c, f"r{i}", params) for i, c in enumerate(cases)])
    for case, req in zip(cases, reqs, strict=True):
        assert req.output_token_ids == hf_generate(model, case.messages, case.images, 8)
