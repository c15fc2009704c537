"""Vision and language in parallel (HydraInfer §4.2; worker/engine/parallel_vision.py):
steps holding encodes and language work run them side by side (two CUDA streams on a GPU)
and give the same tokens as the sequential path; a CPU engine keeps the sequential path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_cases import make_cases, processor, to_request

from triptych.sampling_params import SamplingParams
from triptych.worker.engine import Engine, EngineConfig, FinishReason
from triptych.worker.engine.parallel_vision import ParallelVision

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/worker/conftest.py


def _engine(model_dir: Path, device: str = "cpu", **kw) -> Engine:
    # One image per step: encodes spread over steps where other requests prefill/decode.
    return Engine(EngineConfig(model=str(model_dir), device=device, num_kv_blocks=128, num_mm_blocks=64,
                               mm_block_rows=8, image_budget=1, shuffle_seed=11, **kw))


def _run(engine: Engine, model_dir: Path, n: int = 8) -> list[tuple[list[int], FinishReason | None]]:
    proc = processor(model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    reqs = engine.generate_batch([to_request(proc, c, f"r{i}", params) for i, c in enumerate(make_cases(n))])
    return [(list(r.output_token_ids), r.finish_reason) for r in reqs]


def test_cpu_engine_keeps_the_sequential_path(qwen2_vl_dir: Path) -> None:
    on, off = _engine(qwen2_vl_dir), _engine(qwen2_vl_dir, parallel_vision=False)
    assert on.parallel_vision is None and off.parallel_vision is None
    assert _run(on, qwen2_vl_dir) == _run(off, qwen2_vl_dir)


def test_overlapped_steps_give_the_sequential_tokens(qwen2_vl_dir: Path) -> None:
    """The threaded path (forced on a CPU: no streams) computes what the sequential one does."""
    want = _run(_engine(qwen2_vl_dir, parallel_vision=False), qwen2_vl_dir)
    e = _engine(qwen2_vl_dir)
    e.parallel_vision = ParallelVision(torch.device("cpu"))
    try:
        assert _run(e, qwen2_vl_dir) == want
        assert e.parallel_vision.overlapped_steps > 0  # some steps held both encodes and language
    finally:
        e.parallel_vision.close()


def test_failed_encode_in_an_overlapped_step_fails_only_its_request(qwen2_vl_dir: Path) -> None:
    want = _run(_engine(qwen2_vl_dir, parallel_vision=False), qwen2_vl_dir)
    e = _engine(qwen2_vl_dir)
    e.parallel_vision = ParallelVision(torch.device("cpu"))
    encode = e.vision.encode
    calls = {"n": 0}

    def flaky(inputs):  # the third encode call (an overlapped step) fails
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return encode(inputs)

    e.vision.encode = flaky
    try:
        got = _run(e, qwen2_vl_dir)
    finally:
        e.parallel_vision.close()
    failed = [i for i, (_, why) in enumerate(got) if why == FinishReason.ERROR]
    assert len(failed) == 1 and e.parallel_vision.overlapped_steps > 0
    assert [g for i, g in enumerate(got) if i not in failed] == [w for i, w in enumerate(want) if i not in failed]


@pytest.mark.gpu
def test_two_streams_give_the_sequential_tokens(qwen2_vl_dir: Path) -> None:
    want = _run(_engine(qwen2_vl_dir, "cuda", parallel_vision=False), qwen2_vl_dir)
    e = _engine(qwen2_vl_dir, "cuda")
    assert isinstance(e.parallel_vision, ParallelVision) and e.parallel_vision.stream is not None
    assert _run(e, qwen2_vl_dir) == want
    assert e.parallel_vision.overlapped_steps > 0
