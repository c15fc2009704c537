"""The simulator: exact timings of single requests, queueing theory (M/D/1), monotonicity
in rate and instances, goodput search."""

from __future__ import annotations

from pathlib import Path

import pytest
from planner_models import QWEN2_VL_7B, write_model

from triptych.operator.planner.model_shape import ModelShape, read_shape
from triptych.operator.planner.profile import DecodeRow, EncodeRow, Migration, Point, StepProfile
from triptych.operator.planner.roofline import roofline_profile
from triptych.operator.planner.simulator import SimConfig, Simulation, goodput, simulate
from triptych.operator.planner.workload import TraceRequest, WorkloadSpec, at_rate, fixed, generate, lognormal
from triptych.topology import InstanceType as T
from triptych.topology import parse_topology

SHAPE = ModelShape(family="qwen2-vl", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                   intermediate_size=128, vocab_size=1000, vision_layers=1, vision_hidden=32,
                   vision_intermediate=64, vision_heads=2, patch_size=14, merge_size=2)


def linear_profile(*, enc_per_image: float = 0.02, prefill_per_token: float = 0.001, decode_s: float = 0.01,
                   bytes_per_s: float = 1e6, overhead: float = 0.0) -> StepProfile:
    """Step times that are exact linear functions, so expected timings can be computed."""
    return StepProfile(
        source="test", shape=SHAPE, dtype_bytes=2,
        encode=[EncodeRow(pixels=112 * 112, points=[Point(x=1, seconds=enc_per_image),
                                                     Point(x=64, seconds=64 * enc_per_image)])],
        prefill=[Point(x=1, seconds=prefill_per_token), Point(x=8192, seconds=8192 * prefill_per_token)],
        decode=[DecodeRow(context=0, points=[Point(x=1, seconds=decode_s), Point(x=512, seconds=decode_s)])],
        migration=Migration(latency_s=0.0, bytes_per_s=bytes_per_s), step_overhead_s=overhead,
        kv_capacity_tokens=1 << 20, max_num_seqs=256)


def test_one_request_through_e_p_d_takes_the_sum_of_its_steps_and_migrations() -> None:
    prof = linear_profile()
    tokens = SHAPE.tokens_per_image(112, 112)  # 16 visual tokens
    req = TraceRequest(t=0, images=[(112, 112)], prompt_tokens=20, output_tokens=4)
    sim = Simulation({T.E: 1, T.P: 1, T.D: 1}, prof, SimConfig(ttft_slo_s=10, tbt_slo_s=1))
    report = sim.run([req])
    r = sim.requests[0]
    ep = tokens * SHAPE.embedding_bytes_per_token(2) / 1e6  # embeddings E -> P
    pd = (20 + tokens) * SHAPE.kv_bytes_per_token(2) / 1e6  # KV P -> D
    ttft = 0.02 + ep + (20 + tokens) * 0.001
    assert r.first_token == pytest.approx(ttft)
    assert r.finish == pytest.approx(ttft + pd + 3 * 0.01)  # 3 decode steps after the first token
    assert r.first_gap == pytest.approx(pd + 0.01) and r.gaps == 3
    assert report.slo_attainment == 1.0 and report.completed == 1


def test_request_work_is_charged_once_per_instance_and_ttft_overhead_is_latency() -> None:
    req = TraceRequest(t=0, images=[(112, 112)], prompt_tokens=20, output_tokens=4)
    cfg = SimConfig(ttft_slo_s=10, tbt_slo_s=1)
    base = Simulation({T.E: 1, T.P: 1, T.D: 1}, linear_profile(), cfg)
    base.run([req])
    work = {"E": 0.1, "P": 0.2, "D": 0.3}
    sim = Simulation({T.E: 1, T.P: 1, T.D: 1}, linear_profile(), cfg.model_copy(
        update={"request_work_s": work, "ttft_overhead_s": 0.05}))
    report = sim.run([req])
    b, r = base.requests[0], sim.requests[0]
    assert r.first_token == pytest.approx(b.first_token + 0.1 + 0.2)  # the E step, then the P step
    assert r.finish == pytest.approx(b.finish + 0.1 + 0.2 + 0.3)  # D's first decode step, once
    busy = {i.kind.value: i.busy_time for i in sim.instances}
    assert busy == pytest.approx({k: v + work[k] for k, v in {i.kind.value: i.busy_time
                                                              for i in base.instances}.items()})
    # The overhead is outside the instances: TTFT and E2E only.
    assert report.ttft_p50_s == pytest.approx(r.first_token + 0.05)
    assert report.e2e_p50_s == pytest.approx(r.finish + 0.05)
    # Negative: request work charged before the first token that the served path does
    # after it; TTFT moves earlier (never below 0), the instances stay as busy.
    early = Simulation({T.E: 1, T.P: 1, T.D: 1}, linear_profile(), cfg.model_copy(
        update={"request_work_s": work, "ttft_overhead_s": -0.15})).run([req])
    assert early.ttft_p50_s == pytest.approx(r.first_token - 0.15)
    assert Simulation({T.E: 1, T.P: 1, T.D: 1}, linear_profile(), cfg.model_copy(
        update={"ttft_overhead_s": -100.0})).run([req]).ttft_p50_s == 0.0


@pytest.mark.parametrize("beside", [True, False])
def test_request_work_arriving_at_a_busy_instance(beside: bool) -> None:
    # A decodes on an aggregated instance; B arrives in the middle of it. Beside (the
    # default), B's request work shares the CPU with A's steps before B queues: it takes
    # twice as long (2 x 0.1 s) and sets A back by 0.1 s. In a step, it is charged to the
    # step that takes B on. Either way the instance does the same work and A ends as late.
    a = TraceRequest(t=0, images=[], prompt_tokens=10, output_tokens=100)
    b = TraceRequest(t=0.505, images=[], prompt_tokens=10, output_tokens=2)
    cfg = SimConfig(ttft_slo_s=10, tbt_slo_s=1, request_work_s={"EPD": 0.1}, request_work_beside=beside)
    sim = Simulation({T.EPD: 1}, linear_profile(), cfg)
    sim.run([a, b])
    ra, rb = sim.requests
    assert ra.first_token == pytest.approx(0.1 + 0.01)  # work, then the prefill (idle: no sharing)
    # B queues at 0.705 (beside) or 0.505; A's decode step under way ends at 0.71 or 0.51;
    # then B's prefill with A's decode: 11 tokens, plus the 0.1 s.
    assert rb.first_token == pytest.approx((0.71 if beside else 0.51) + 0.011 + 0.1)
    assert ra.finish == pytest.approx(0.11 + 99 * 0.01 + 0.1 + 0.001)
    busy = sim.instances[0].busy_time
    assert busy == pytest.approx(2 * 0.1 + 0.01 + 98 * 0.01 + 0.011)
    assert sim.instances[0].owed == 0.0


def test_decode_token_overhead_is_paid_per_decoding_request() -> None:
    prof = linear_profile().model_copy(update={"decode_token_overhead_s": 0.002})
    assert prof.step_s(decodes=1) == pytest.approx(0.01 + 0.002)
    assert prof.step_s(decodes=8) == pytest.approx(0.01 + 8 * 0.002)  # the forward is shared, not this
    assert prof.step_s(prefill_tokens=10) == pytest.approx(0.01)


def test_aggregated_instance_moves_nothing() -> None:
    prof = linear_profile(bytes_per_s=1.0)  # any transfer would take ages
    sim = Simulation({T.EPD: 1}, prof, SimConfig(ttft_slo_s=10, tbt_slo_s=1))
    sim.run([TraceRequest(t=0, images=[(112, 112)], prompt_tokens=20, output_tokens=3)])
    r = sim.requests[0]
    assert r.first_token == pytest.approx(0.02 + 36 * 0.001)
    assert r.finish == pytest.approx(r.first_token + 2 * 0.01)


def test_a_slow_first_gap_counts_against_the_tbt_slo() -> None:
    # PD migration of 36 tokens of KV at 1 kB/s: far over a 50 ms TBT SLO, 1 gap of 2
    prof = linear_profile(bytes_per_s=1e3)
    sim = Simulation({T.P: 1, T.D: 1}, prof, SimConfig(ttft_slo_s=10, tbt_slo_s=0.05))
    report = sim.run([TraceRequest(t=0, prompt_tokens=36, output_tokens=3)])
    assert sim.requests[0].slow_gaps == 1 and report.slo_attainment == 0.0


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_single_instance_matches_m_d_1(rho: float) -> None:
    """Text-only requests of 100 tokens, one per step (token budget 100), one output token:
    an M/D/1 queue with service S = 0.1 s. Mean TTFT = S + rho S / (2 (1 - rho))."""
    s = 0.1
    prof = linear_profile(prefill_per_token=s / 100)
    spec = WorkloadSpec(rate=rho / s, num_requests=20000, images_per_request=fixed(0),
                        prompt_tokens=fixed(100), output_tokens=fixed(1), seed=7)
    sim = Simulation({T.EPD: 1}, prof, SimConfig(ttft_slo_s=100, tbt_slo_s=1, token_budget=100))
    sim.run(generate(spec))
    mean = sum(r.first_token - r.arrival for r in sim.requests) / len(sim.requests)
    expected = s + rho * s / (2 * (1 - rho))
    assert mean == pytest.approx(expected, rel=0.05)


@pytest.fixture(scope="module")
def q7b(tmp_path_factory: pytest.TempPathFactory) -> StepProfile:
    return roofline_profile(read_shape(write_model(tmp_path_factory.mktemp("q7b"), QWEN2_VL_7B)), "L40S")


def test_attainment_falls_and_latency_rises_with_rate(q7b: StepProfile) -> None:
    trace = generate(WorkloadSpec(num_requests=600, images_per_request=fixed(2), prompt_tokens=lognormal(100, 0.6),
                                  output_tokens=lognormal(100, 0.6, 1, 1000)))
    cfg = SimConfig(ttft_slo_s=2, tbt_slo_s=0.1)
    reports = [simulate(parse_topology("1E2P2D"), q7b, at_rate(trace, r), cfg) for r in (2, 8, 16, 32, 64)]
    att = [r.slo_attainment for r in reports]
    ttft = [r.ttft_p90_s for r in reports]
    assert att == sorted(att, reverse=True) and att[0] == 1.0 and att[-1] < 0.5
    assert ttft == sorted(ttft)
    assert reports[0].sustained and not reports[-1].sustained


def test_goodput_grows_with_instances_and_is_a_passing_rate(q7b: StepProfile) -> None:
    trace = generate(WorkloadSpec(num_requests=300, images_per_request=fixed(1), prompt_tokens=lognormal(60, 0.5),
                                  output_tokens=lognormal(80, 0.5, 1, 800)))
    cfg = SimConfig(ttft_slo_s=2, tbt_slo_s=0.1)
    small = goodput(parse_topology("1E1P1D"), q7b, trace, cfg, 10.0, min_duration_s=15)
    big = goodput(parse_topology("2E2P2D"), q7b, trace, cfg, 10.0, min_duration_s=15)
    assert 1.6 * small.goodput_rps <= big.goodput_rps <= 2.4 * small.goodput_rps
    # the reported rate passed, the next grid rate up failed
    assert small.attainment_by_rate[f"{small.goodput_rps:.4g}"] >= 0.9
    assert small.attainment_by_rate[f"{small.goodput_rps * 1.03:.4g}"] < 0.9


def test_least_loaded_routing_beats_round_robin_on_uneven_requests(q7b: StepProfile) -> None:
    trace = generate(WorkloadSpec(rate=6, num_requests=600, images_per_request=fixed(0),
                                  prompt_tokens=lognormal(400, 1.2, 1, 8000), output_tokens=lognormal(50, 1.0, 1, 800)))
    rr = simulate({T.PD: 4}, q7b, trace, SimConfig(ttft_slo_s=1, tbt_slo_s=0.1))
    ll = simulate({T.PD: 4}, q7b, trace, SimConfig(ttft_slo_s=1, tbt_slo_s=0.1, routing="least-loaded"))
    assert ll.ttft_p99_s <= rr.ttft_p99_s


def test_topology_without_a_stage_is_refused(q7b: StepProfile) -> None:
    with pytest.raises(ValueError, match="runs the encode stage"):
        simulate({T.P: 1, T.D: 1}, q7b, [TraceRequest(t=0, images=[(448, 448)], prompt_tokens=5, output_tokens=2)],
                 SimConfig())


def test_model_dir_is_read_from_config_json(tmp_path: Path) -> None:
    shape = read_shape(write_model(tmp_path, QWEN2_VL_7B))
    assert (shape.num_layers, shape.hidden_size, shape.num_kv_heads, shape.head_dim) == (28, 3584, 4, 128)
    assert shape.tokens_per_image(448, 448) == 256


def test_goodput_without_a_finite_guess_still_searches(q7b: StepProfile) -> None:
    trace = generate(WorkloadSpec(num_requests=100, images_per_request=fixed(0), output_tokens=fixed(1)))
    g = goodput({T.EPD: 1}, q7b, trace, SimConfig(ttft_slo_s=2, tbt_slo_s=0.1), float("inf"), min_duration_s=5)
    assert 0 < g.goodput_rps < float("inf")


def test_measured_noise_spreads_each_request_in_turn_and_counts_against_the_slo() -> None:
    # Four identical, well separated requests: without noise every TTFT and TPOT is the same,
    # so p90 equals p50; with it the k-th request gets the (k mod n)-th offset and factor.
    prof = linear_profile()
    trace = [TraceRequest(t=float(k), prompt_tokens=20, output_tokens=3) for k in range(4)]
    plain = simulate({T.EPD: 1}, prof, trace, SimConfig(ttft_slo_s=10, tbt_slo_s=1))
    assert plain.ttft_p50_s == plain.ttft_p90_s and plain.tpot_p50_s == plain.tpot_p90_s
    cfg = SimConfig(ttft_slo_s=plain.ttft_p50_s + 0.05, tbt_slo_s=1, ttft_overhead_s=0.01,
                    ttft_noise_s=[0.0, 0.1], tpot_noise=[1.0, 1.0, 1.0, 2.0])
    noisy = simulate({T.EPD: 1}, prof, trace, cfg)
    assert noisy.ttft_p50_s == pytest.approx(plain.ttft_p50_s + 0.01)
    assert noisy.ttft_p90_s == pytest.approx(plain.ttft_p50_s + 0.11)
    assert noisy.tpot_p50_s == pytest.approx(plain.tpot_p50_s)
    assert noisy.tpot_p90_s == pytest.approx(2 * plain.tpot_p50_s)
    assert noisy.slo_attainment == 0.5  # requests 1 and 3 start 0.11 s late, over the TTFT SLO
