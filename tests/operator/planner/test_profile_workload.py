"""Workload traces and specs; step-time profiles and the roofline model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from planner_models import LLAVA_15_7B, QWEN2_VL_7B, write_model

from triptych.operator.planner.model_shape import ModelShapeError, read_shape
from triptych.operator.planner.profile import StepProfile
from triptych.operator.planner.roofline import GPUS, Efficiency, Roofline, roofline_profile
from triptych.operator.planner.workload import (
    TraceRequest,
    WorkloadSpec,
    at_rate,
    fixed,
    generate,
    lognormal,
    mean_rate,
    read_trace,
    resample,
    stats,
    tile,
    write_trace,
)


# --- workloads ---------------------------------------------------------------------------
def test_trace_round_trip(tmp_path: Path) -> None:
    reqs = [TraceRequest(t=0.5, images=[(640, 480), (32, 32)], prompt_tokens=12, output_tokens=7),
            TraceRequest(t=1.25, prompt_tokens=3, output_tokens=1)]
    write_trace(tmp_path / "t.jsonl", reqs)
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    assert lines[0] == '{"t": 0.5, "images": [[640, 480], [32, 32]], "prompt_tokens": 12, "output_tokens": 7}'
    assert read_trace(tmp_path / "t.jsonl") == reqs


def test_bad_trace_line_names_the_line(tmp_path: Path) -> None:
    (tmp_path / "t.jsonl").write_text('{"t": 0, "prompt_tokens": 3, "output_tokens": 1}\n{"t": 1, "prompt_tokens": 0}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:2: not a trace request"):
        read_trace(tmp_path / "t.jsonl")


def test_synthetic_spec_is_deterministic_and_has_its_rate_and_tails() -> None:
    spec = WorkloadSpec(rate=4, num_requests=4000, images_per_request=fixed(2),
                        prompt_tokens=lognormal(100, 1.0, 1, 2000), output_tokens=fixed(9), seed=3)
    a, b = generate(spec), generate(spec)
    assert a == b and generate(spec, seed=4) != a
    assert mean_rate(a) == pytest.approx(4, rel=0.05)
    prompts = sorted(r.prompt_tokens for r in a)
    assert prompts[len(prompts) // 2] == pytest.approx(100, rel=0.1)  # the median
    assert prompts[-1] == 2000  # the long tail is clipped at high
    assert all(len(r.images) == 2 and r.output_tokens == 9 for r in a)


def test_at_rate_tile_resample_keep_the_shape() -> None:
    base = generate(WorkloadSpec(rate=2, num_requests=50, output_tokens=lognormal(20, 0.5)))
    fast = at_rate(base, 10)
    assert mean_rate(fast) == pytest.approx(10) and [r.output_tokens for r in fast] == [r.output_tokens for r in base]
    long = tile(base, 120)
    assert len(long) == 120 and long[50].output_tokens == base[0].output_tokens and long[50].t > long[49].t
    rep = resample(base, seed=1)
    assert len(rep) == 50 and {r.output_tokens for r in rep} <= {r.output_tokens for r in base}
    assert stats(base).images_per_request == 1 and stats(base).image_pixels == 448 * 448


# --- model shapes --------------------------------------------------------------------------
def test_shapes_from_config_json(tmp_path: Path) -> None:
    q = read_shape(write_model(tmp_path / "q", QWEN2_VL_7B))
    ll = read_shape(write_model(tmp_path / "l", LLAVA_15_7B))
    assert q.lm_params == pytest.approx(7.6e9, rel=0.02)  # Qwen2-VL-7B's language model
    assert ll.lm_params == pytest.approx(6.74e9, rel=0.02)  # Llama-2-7B (Llama defaults filled in)
    assert ll.tokens_per_image(1920, 1080) == 576  # CLIP-L/336: every image is 24 x 24 patches
    assert q.tokens_per_image(448, 448) == 256 and q.tokens_per_image(4032, 3024) == 1230  # smart_resize to 840 x 1148 under max_pixels
    assert q.kv_bytes_per_token(2) == 2 * 28 * 4 * 128 * 2
    with pytest.raises(ModelShapeError, match="cannot read"):
        read_shape(tmp_path / "missing")


# --- roofline (HydraInfer Table 2) and profiles -----------------------------------------------
@pytest.fixture(scope="module")
def roof(tmp_path_factory: pytest.TempPathFactory) -> Roofline:
    shape = read_shape(write_model(tmp_path_factory.mktemp("l"), LLAVA_15_7B))
    return Roofline(shape, GPUS["H100"], Efficiency())


def test_decode_of_one_token_is_memory_bound(roof: Roofline) -> None:
    # reading the weights once dominates: params * 2 bytes / (bandwidth * efficiency)
    weights = roof.shape.lm_params * 2 / (3.35e12 * 0.8)
    assert roof.decode(1, 0) == pytest.approx(weights, rel=0.05)
    # and a batch of 8 costs about the same (still memory-bound)
    assert roof.decode(8, 0) < 1.05 * roof.decode(1, 0)


def test_long_prefill_matmuls_are_compute_bound(roof: Roofline) -> None:
    n, s = 4096, roof.shape
    w = s.lm_linear_params
    compute = 2 * n * w / (989e12 * 0.6)
    assert roof._op(2 * n * w, w + 12 * n * s.hidden_size) == pytest.approx(compute)
    # Table 2's attention keeps the n x n scores in memory: 2 n^2 M elements, memory-bound here
    scores = (4 * n * s.hidden_size + 2 * n * n * s.num_heads) * 2 / (3.35e12 * 0.8)
    assert roof._op(4 * n * n * s.hidden_size, 4 * n * s.hidden_size + 2 * n * n * s.num_heads) == pytest.approx(scores)
    assert roof.prefill(n) == pytest.approx(s.num_layers * (compute + scores) + roof._lm_head(1))


def test_decode_attention_grows_with_context(roof: Roofline) -> None:
    assert roof.decode(64, 4096) > 1.5 * roof.decode(64, 0)


def test_profile_tables_budgets_and_persistence(roof: Roofline, tmp_path: Path) -> None:
    prof = roof.profile()
    limit = 0.05
    b = prof.token_budget(limit)
    assert prof.step_s(prefill_tokens=b) <= limit < prof.step_s(prefill_tokens=b + 1)
    n = prof.image_budget(limit, 336 * 336)
    assert prof.step_s(images=n, pixels=336 * 336) <= limit < prof.step_s(images=n + 1, pixels=336 * 336)
    # interpolation reproduces the table at its points
    assert prof.decode_s(32, 1024) == pytest.approx(roof.decode(32, 1024))
    assert prof.prefill_s(1024) == pytest.approx(roof.prefill(1024))
    # KV that fits next to the weights (TriInfer Alg. 2 line 9, gamma = 0.9)
    free = 80e9 * 0.9 - roof.shape.lm_params * 2
    assert prof.kv_capacity_tokens == math.floor(free / roof.shape.kv_bytes_per_token(2))
    prof.save(tmp_path / "p.json")
    assert StepProfile.load(tmp_path / "p.json") == prof


def test_every_listed_gpu_builds_a_profile(roof: Roofline) -> None:
    speeds = {g: roofline_profile(roof.shape, g).decode_s(64, 1024) for g in ("H100", "H200", "A100", "L40S")}
    assert speeds["H200"] < speeds["H100"] < speeds["A100"] < speeds["L40S"]
    with pytest.raises(ValueError, match="unknown GPU"):
        roofline_profile(roof.shape, "T4")
