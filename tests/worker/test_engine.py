"""Engine behaviour beyond parity: role-aware loading, stage entry/exit points (E -> P -> D
hand-offs through the caches), sampling options, bad inputs while serving, aborts, the
asyncio driver, counters and SLO budgets."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch
from engine_cases import make_cases, processor, to_request
from hf_reference import make_test_image, png_bytes

from triptych.sampling_params import SamplingParams
from triptych.slo_budgets import latency_limit
from triptych.topology import InstanceType, Stage
from triptych.worker.engine import (
    Engine,
    EngineConfig,
    FinishReason,
    ImageTooLargeError,
    InvalidImageError,
    MissingEmbeddingError,
    PrefilledKV,
    PromptTooLongError,
    Request,
    RequestStatus,
    RequestValidationError,
    StageNotServedError,
)
from triptych.worker.models.spec import UnsupportedCheckpointError

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/worker/conftest.py


def _engine(model_dir: Path, role: InstanceType = InstanceType.EPD, **kw) -> Engine:
    kw.setdefault("num_kv_blocks", 128)
    kw.setdefault("num_mm_blocks", 64)
    kw.setdefault("mm_block_rows", 8)
    return Engine(EngineConfig(model=str(model_dir), role=role, shuffle_seed=11, **kw))


def _params(**kw) -> SamplingParams:
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", 8)
    return SamplingParams(**kw)


# --- role-aware loading ---------------------------------------------------------------

def test_encode_instance_holds_no_llm_and_no_kv_cache(tiny_model_dir: Path) -> None:
    e = _engine(tiny_model_dir, InstanceType.E)
    assert e.language is None and e.kv is None and e.vision is not None
    names = [n for n, _ in e.vision.named_parameters()]
    assert names and all(n.split(".")[0] in ("visual", "vision_tower", "multi_modal_projector") for n in names)
    assert not any("embed_tokens" in n or "lm_head" in n for n in names)
    stats = e.stats()
    assert "kv_cache" not in stats and stats["mm_cache"]["bytes"] == e.mm.tensor.numel() * 4


@pytest.mark.parametrize("role", [InstanceType.P, InstanceType.D, InstanceType.PD])
def test_llm_instances_hold_no_vision_weights(qwen2_vl_dir: Path, role: InstanceType) -> None:
    from triptych.worker.models.language import LanguageModel

    e = _engine(qwen2_vl_dir, role)
    assert e.vision is None and isinstance(e.language, LanguageModel)
    assert not any(n.startswith(("visual", "vision_tower")) for n, _ in e.language.named_parameters())
    spec = e.spec
    kv_bytes = 128 * spec.num_layers * 2 * 16 * spec.num_kv_heads * spec.head_dim * 4
    assert e.stats()["kv_cache"]["bytes"] == kv_bytes == e.kv.tensor.numel() * 4
    assert (e.mm is None) == (role == InstanceType.D)  # D never sees embeddings


def test_unknown_family_is_a_typed_error(tmp_path: Path, qwen2_vl_dir: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(qwen2_vl_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config["model_type"] = "mamba_vl"
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedCheckpointError, match="mamba_vl"):
        Engine(EngineConfig(model=str(bad)))


# --- E -> P -> D through the caches -------------------------------------------------------

def _copy_blocks(dst: torch.Tensor, dst_ids: list[int], src: torch.Tensor, src_ids: list[int]) -> None:
    """What the transfer layer does over NIXL: block-for-block copy between caches."""
    dst[torch.tensor(dst_ids)] = src[torch.tensor(src_ids)]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_disaggregated_stages_give_the_aggregated_output(qwen2_vl_dir: Path, temperature: float) -> None:
    proc = processor(qwen2_vl_dir)
    case = make_cases(4)[3]  # three images
    params = _params(temperature=temperature, seed=1234, max_tokens=10, ignore_eos=True)
    epd = _engine(qwen2_vl_dir)
    (whole,) = epd.generate_batch([to_request(proc, case, "x", params)])

    e, p, d = (_engine(qwen2_vl_dir, r) for r in (InstanceType.E, InstanceType.P, InstanceType.D))
    # E: encode, then park holding the embeddings.
    (er,) = e.generate_batch([to_request(proc, case, "x", params, stages={Stage.ENCODE})])
    assert er.status == RequestStatus.PARKED and er.handoff.stage == Stage.ENCODE and e.mm.num_used > 0
    mm_handoff = {h: (ids, rows) for h, ids, rows in er.handoff.mm}
    assert set(mm_handoff) == {it.content_hash for it in er.mm_items}
    # P pulls the embeddings into blocks it reserves, then prefills and samples token 1.
    for h, (ids, rows) in mm_handoff.items():
        entry = p.reserve_mm(h, rows)
        _copy_blocks(p.mm.tensor, entry.block_ids, e.mm.tensor, ids)
        p.commit_mm(entry)
        p.release_mm(entry)  # the cache keeps it; the request takes its own reference
    e.release("x")
    e.step()
    assert all(en.refcount == 0 for en in e.mm._entries.values())
    pr = to_request(proc, case, "x", params, stages={Stage.PREFILL})
    pr.images = {}
    p.generate_batch([pr])
    assert pr.status == RequestStatus.PARKED and p.stats()["counters"]["images_encoded"] == 0
    kv = pr.handoff
    assert kv.stage == Stage.PREFILL and kv.num_kv_tokens == pr.num_prompt_tokens
    assert kv.first_token == whole.output_token_ids[0] and p.kv.num_used == len(kv.kv_block_ids)
    # D pulls the KV blocks and decodes the rest; P frees once told.
    ids = d.reserve_kv(kv.num_kv_tokens)
    _copy_blocks(d.kv.tensor, ids, p.kv.tensor, kv.kv_block_ids)
    dr = to_request(proc, case, "x", params, stages={Stage.DECODE},
                    prefilled=PrefilledKV(ids, kv.num_kv_tokens, kv.first_token))
    dr.images = {}
    d.generate_batch([dr])
    p.release("x")
    p.step()
    assert p.kv.num_used == 0 and d.kv.num_used == 0
    assert dr.output_token_ids == whole.output_token_ids
    assert d.stats()["counters"]["prefill_tokens"] == 0  # D computed no prompt token


def test_p_instance_needs_pulled_embeddings(qwen2_vl_dir: Path) -> None:
    proc = processor(qwen2_vl_dir)
    p = _engine(qwen2_vl_dir, InstanceType.P)
    req = to_request(proc, make_cases(2)[1], "y", stages={Stage.PREFILL})
    with pytest.raises(MissingEmbeddingError, match="MM cache"):
        p.add_request(req)
    with pytest.raises(StageNotServedError, match="encode"):
        p.add_request(to_request(proc, make_cases(2)[1], "z"))


def test_refused_decode_request_gives_its_reserved_blocks_back(qwen2_vl_dir: Path) -> None:
    d = _engine(qwen2_vl_dir, InstanceType.D)
    ids = d.reserve_kv(20)
    assert d.kv.num_used == 2
    bad = Request("d", [5] * 20, _params(), stages={Stage.DECODE},
                  prefilled=PrefilledKV(ids, 20, first_token=d.spec.vocab_size))
    with pytest.raises(RequestValidationError, match="vocabulary"):
        d.add_request(bad)
    assert d.kv.num_used == 0


def test_prefill_only_request_that_finishes_at_token_one_frees_its_blocks(qwen2_vl_dir: Path) -> None:
    proc = processor(qwen2_vl_dir)
    p = _engine(qwen2_vl_dir, InstanceType.EP)
    (r,) = p.generate_batch([to_request(proc, make_cases(1)[0], "o", _params(max_tokens=1),
                                        stages={Stage.ENCODE, Stage.PREFILL})])
    assert r.status == RequestStatus.FINISHED and r.finish_reason == FinishReason.LENGTH
    assert p.kv.num_used == 0


# --- sampling options through the engine -------------------------------------------------

def test_seeded_sampling_is_independent_of_batch_composition(qwen2_vl_dir: Path) -> None:
    proc = processor(qwen2_vl_dir)
    cases = make_cases(8)
    params = _params(temperature=1.0, top_p=0.95, seed=77, max_tokens=12, ignore_eos=True)
    alone = _engine(qwen2_vl_dir).generate_batch([to_request(proc, cases[2], "t", params)])[0]
    others = [to_request(proc, c, f"o{i}", _params(temperature=0.7, seed=i, max_tokens=5 + i))
              for i, c in enumerate(cases)]
    crowd = _engine(qwen2_vl_dir, token_budget=11, block_size=4)
    target = to_request(proc, cases[2], "t", params)
    crowd.generate_batch(others[:5] + [target] + others[5:])
    assert target.output_token_ids == alone.output_token_ids
    other_seed = _engine(qwen2_vl_dir).generate_batch(
        [to_request(proc, cases[2], "t", _params(temperature=1.0, top_p=0.95, seed=78, max_tokens=12,
                                                  ignore_eos=True))])[0]
    assert other_seed.output_token_ids != alone.output_token_ids


def test_unseeded_requests_draw_their_own_seed(qwen2_vl_dir: Path) -> None:
    proc = processor(qwen2_vl_dir)
    e = _engine(qwen2_vl_dir)
    reqs = [to_request(proc, make_cases(1)[0], f"u{i}", _params(temperature=1.0, max_tokens=12, ignore_eos=True))
            for i in range(2)]
    e.generate_batch(reqs)
    assert reqs[0].seed != reqs[1].seed
    assert reqs[0].output_token_ids != reqs[1].output_token_ids


def test_stop_strings_stop_tokens_and_lengths(qwen2_vl_dir: Path) -> None:
    proc = processor(qwen2_vl_dir)
    case = make_cases(2)[1]
    e = _engine(qwen2_vl_dir)
    (free,) = e.generate_batch([to_request(proc, case, "a", _params(max_tokens=16, ignore_eos=True))])
    assert free.finish_reason == FinishReason.LENGTH and len(free.output_token_ids) == 16
    text = free.text
    assert len(text) > 8
    stop = text[5:8]
    first = text.find(stop)
    (cut,) = e.generate_batch([to_request(proc, case, "b", _params(max_tokens=16, ignore_eos=True, stop=[stop]))])
    assert cut.finish_reason == FinishReason.STOP and cut.text == text[:first]
    assert len(cut.output_token_ids) < 16
    tok = free.output_token_ids[3]
    (st,) = e.generate_batch([to_request(proc, case, "c", _params(max_tokens=16, stop_token_ids=[tok]))])
    k = free.output_token_ids.index(tok)
    assert st.finish_reason == FinishReason.STOP and st.output_token_ids == free.output_token_ids[:k + 1]


def test_eos_stops_unless_ignored(qwen2_vl_dir: Path) -> None:
    proc = processor(qwen2_vl_dir)
    e = _engine(qwen2_vl_dir)
    case = make_cases(1)[0]
    (free,) = e.generate_batch([to_request(proc, case, "a", _params(max_tokens=12, ignore_eos=True))])
    # Treat the 4th generated token as the model's EOS: generation must stop right there.
    e.eos_ids = frozenset({free.output_token_ids[3]})
    (stopped,) = e.generate_batch([to_request(proc, case, "b", _params(max_tokens=12))])
    k = free.output_token_ids.index(free.output_token_ids[3])
    assert stopped.finish_reason == FinishReason.STOP and stopped.output_token_ids == free.output_token_ids[:k + 1]
    (ignored,) = e.generate_batch([to_request(proc, case, "c", _params(max_tokens=12, ignore_eos=True))])
    assert ignored.output_token_ids == free.output_token_ids


def test_logprobs_are_reported(qwen2_vl_dir: Path) -> None:
    proc = processor(qwen2_vl_dir)
    e = _engine(qwen2_vl_dir)
    (r,) = e.generate_batch([to_request(proc, make_cases(1)[0], "l",
                                        _params(max_tokens=4, ignore_eos=True, logprobs=True, top_logprobs=3))])
    assert [lp["token"] for lp in r.logprobs] == r.output_token_ids
    for lp in r.logprobs:
        assert lp["top"][0][0] == lp["token"] and lp["logprob"] <= 0 and len(lp["top"]) == 3


# --- caches and counters ----------------------------------------------------------------

def test_repeated_image_is_encoded_once(qwen2_vl_dir: Path) -> None:
    proc = processor(qwen2_vl_dir)
    e = _engine(qwen2_vl_dir)
    img = make_test_image(5, 56, 56)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "a"}]}]
    msgs2 = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "something else"}]}]
    from engine_cases import Case

    reqs = [to_request(proc, Case(msgs, [img]), "a"), to_request(proc, Case(msgs2, [img]), "b")]
    e.generate_batch(reqs[:1])
    e.generate_batch(reqs[1:])
    counters = e.stats()["counters"]
    assert counters["images_encoded"] == 1 and counters["mm_cache_hits"] == 1


def test_stats_report_occupancy_and_timings(qwen2_vl_dir: Path) -> None:
    proc = processor(qwen2_vl_dir)
    e = _engine(qwen2_vl_dir)
    reqs = [to_request(proc, c, f"s{i}") for i, c in enumerate(make_cases(4))]
    for r in reqs:
        e.add_request(r)
    e.step()
    e.step()
    mid = e.stats()
    assert mid["kv_cache"]["used"] > 0 and mid["num_running"] == 4
    while e.has_work:
        e.step()
    t = reqs[3].timings
    assert t.arrival <= t.first_scheduled <= t.encode_start <= t.encode_end <= t.prefill_end <= t.first_token
    assert t.prefill_start <= t.prefill_end and len(t.token_times) == len(reqs[3].output_token_ids)
    assert reqs[0].timings.encode_start is None  # no images
    end = e.stats()
    assert end["kv_cache"]["used"] == 0 and end["counters"]["decode_tokens"] > 0


# --- bad inputs, aborts, and the asyncio driver ------------------------------------------

def _bad_requests(proc, e: Engine) -> list[tuple[Request, type[Exception]]]:
    case = make_cases(2)[1]
    good = to_request(proc, case, "tmp")
    h = good.mm_items[0].content_hash
    corrupt = to_request(proc, case, "corrupt")
    corrupt.images = {h: png_bytes(case.images[0])[:60]}
    too_big = to_request(proc, case, "big")
    too_big.images = {h: png_bytes(make_test_image(0, 300, 300))}
    long = Request("long", [5] * e.max_model_len, _params())
    return [(corrupt, InvalidImageError), (too_big, ImageTooLargeError), (long, PromptTooLongError)]


async def test_bad_inputs_fail_alone_while_good_requests_stream(qwen2_vl_dir: Path) -> None:
    proc = processor(qwen2_vl_dir)
    cases = make_cases(4)
    expected = _engine(qwen2_vl_dir).generate_batch([to_request(proc, c, f"g{i}") for i, c in enumerate(cases)])
    e = _engine(qwen2_vl_dir, max_image_pixels=200 * 200)
    bad = _bad_requests(proc, e)

    async def run(req: Request) -> list[int]:
        tokens: list[int] = []
        async for out in e.generate(req, timeout_s=60):
            tokens.extend(out.new_token_ids)
            if out.finished:
                assert out.finish_reason is not None and out.timings["ttft"] > 0
        return tokens

    try:
        jobs = [run(to_request(proc, c, f"g{i}")) for i, c in enumerate(cases)] + [run(r) for r, _ in bad]
        results = await asyncio.gather(*jobs, return_exceptions=True)
    finally:
        e.stop()
    for got, want in zip(results[:4], expected, strict=True):
        assert got == want.output_token_ids
    for got, (_, kind) in zip(results[4:], bad, strict=True):
        assert isinstance(got, kind) and isinstance(got, RequestValidationError), got
    assert "pixels" in str(results[5]) and "context" in str(results[6])
    assert e.stats()["kv_cache"]["used"] == 0


async def test_leaving_the_stream_aborts_and_frees_blocks(qwen2_vl_dir: Path) -> None:
    proc = processor(qwen2_vl_dir)
    e = _engine(qwen2_vl_dir)
    try:
        stream = e.generate(to_request(proc, make_cases(4)[3], "z", _params(max_tokens=500, ignore_eos=True)))
        async for out in stream:
            if out.new_token_ids:
                break  # the client went away after its first token
        await stream.aclose()
        for _ in range(200):
            if e.stats()["kv_cache"]["used"] == 0 and e.stats()["num_running"] == 0:
                break
            await asyncio.sleep(0.01)
        stats = e.stats()
        assert stats["kv_cache"]["used"] == 0 and stats["num_running"] == 0
        assert all(en.refcount == 0 for en in e.mm._entries.values())
    finally:
        e.stop()


def test_abort_in_every_state_frees_everything(qwen2_vl_dir: Path) -> None:
    proc = processor(qwen2_vl_dir)
    e = _engine(qwen2_vl_dir, token_budget=8)
    reqs = [to_request(proc, c, f"a{i}", _params(max_tokens=30, ignore_eos=True)) for i, c in enumerate(make_cases(8))]
    for r in reqs:
        e.add_request(r)
    for _ in range(4):
        e.step()
    states = {r.status for r in reqs}
    assert len(states) >= 2  # some decoding, some still waiting or encoding
    for r in reqs:
        e.abort(r.request_id)
    outs = e.step()
    assert {o.finish_reason for o in outs} == {FinishReason.ABORT}
    assert all(r.status == RequestStatus.FINISHED for r in reqs)
    assert e.kv.num_used == 0 and all(en.refcount == 0 for en in e.mm._entries.values())
    assert not e.has_work


def test_a_failing_model_call_fails_only_its_batch(qwen2_vl_dir: Path) -> None:
    proc = processor(qwen2_vl_dir)
    e = _engine(qwen2_vl_dir)
    text = to_request(proc, make_cases(1)[0], "text", _params(max_tokens=6))
    e.generate_batch([text])  # the text request alone, for reference
    poisoned = to_request(proc, make_cases(2)[1], "img")
    h = poisoned.mm_items[0].content_hash
    text2 = to_request(proc, make_cases(1)[0], "text2", _params(max_tokens=6))
    e.add_request(text2)
    e.add_request(poisoned)
    poisoned.vision_inputs[h].pixel_values = torch.zeros(3, 3)  # breaks the vision tower
    while e.has_work:
        e.step()
    assert poisoned.finish_reason == FinishReason.ERROR and poisoned.error
    assert text2.finish_reason == FinishReason.LENGTH and text2.output_token_ids == text.output_token_ids
    assert e.kv.num_used == 0


def test_request_validation_messages(qwen2_vl_dir: Path) -> None:
    e = _engine(qwen2_vl_dir)
    with pytest.raises(RequestValidationError, match="vocabulary"):
        e.add_request(Request("v", [e.spec.vocab_size + 5], _params()))
    with pytest.raises(PromptTooLongError, match="KV"):
        _engine(qwen2_vl_dir, num_kv_blocks=2).add_request(Request("k", [5] * 20, _params(max_tokens=40)))
    e.add_request(Request("dup", [5, 6], _params()))
    with pytest.raises(RequestValidationError, match="already in use"):
        e.add_request(Request("dup", [5, 6], _params()))
    with pytest.raises(StageNotServedError):
        _engine(qwen2_vl_dir, InstanceType.E).add_request(Request("w", [5, 6], _params()))


# --- budgets from SLOs --------------------------------------------------------------------

def test_budgets_from_slo_by_profiling(qwen2_vl_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Injected step costs (the real ones are measured with the same calls at start-up).
    monkeypatch.setattr(Engine, "measure_prefill", lambda self, n: 0.001 + 0.0001 * n)
    monkeypatch.setattr(Engine, "measure_encode", lambda self, n, size=(448, 448): 0.01 * n)
    pd = _engine(qwen2_vl_dir, InstanceType.PD, tbt_slo_s=0.0505, num_kv_blocks=1024)
    assert pd.token_budget == 495  # 1 ms + 0.1 ms/token <= TBT SLO
    ep = _engine(qwen2_vl_dir, InstanceType.EP, ttft_slo_s=0.101, num_kv_blocks=1024)
    assert latency_limit(InstanceType.EP, 0.101, None) == pytest.approx(0.0505)
    assert ep.token_budget == 495 and ep.image_budget == 5  # alpha * TTFT
    fixed = _engine(qwen2_vl_dir, InstanceType.EP, ttft_slo_s=0.101, token_budget=64)
    assert fixed.token_budget == 64  # configured budgets win


def test_real_profiling_gives_usable_budgets(qwen2_vl_dir: Path) -> None:
    e = _engine(qwen2_vl_dir, InstanceType.PD, tbt_slo_s=30.0, num_kv_blocks=8)
    assert e.token_budget == 8 * 16  # a generous SLO: capped by the KV capacity
    tight = _engine(qwen2_vl_dir, InstanceType.PD, tbt_slo_s=1e-6, token_budget=None, num_kv_blocks=8)
    assert tight.token_budget == 1  # never below one token: the engine must make progress


async def test_an_unexpected_step_failure_fails_requests_instead_of_hanging(qwen2_vl_dir: Path) -> None:
    proc = processor(qwen2_vl_dir)
    e = _engine(qwen2_vl_dir)
    schedule = e.scheduler.schedule
    calls = {"n": 0}

    def flaky() -> object:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("scheduler bug")
        return schedule()

    e.scheduler.schedule = flaky
    try:
        outs = [o async for o in e.generate(to_request(proc, make_cases(1)[0], "f", _params(max_tokens=20)),
                                            timeout_s=30)]
        assert outs[-1].finished and outs[-1].finish_reason == FinishReason.ERROR
        assert "scheduler bug" in outs[-1].error
        after = [o async for o in e.generate(to_request(proc, make_cases(1)[0], "g", _params(max_tokens=3)),
                                             timeout_s=30)]
        assert after[-1].finish_reason == FinishReason.LENGTH  # still serving
        assert e.stats()["kv_cache"]["used"] == 0
    finally:
        e.stop()


def test_n_choices_fork_one_prefill_into_seeded_streams(qwen2_vl_dir: Path) -> None:
    """n > 1 at the engine (worker/choices.py drives this over HTTP): the prefill samples
    each choice's first token with its own seed, `fork_kv` copies the prompt's KV, and each
    choice decodes exactly what an n=1 request with that choice's seed does alone."""
    from triptych.sampling_params import choice_seed

    eng = _engine(qwen2_vl_dir)
    prompt = [(7 * j) % 500 + 3 for j in range(37)]  # spans blocks, the last one partly full
    params = _params(temperature=1.0, seed=1234, max_tokens=6, ignore_eos=True, n=3)
    pre = Request("p", prompt, params, stages={Stage.PREFILL})
    eng.generate_batch([pre])
    assert pre.status == RequestStatus.PARKED and len(pre.choice_firsts) == 2
    assert eng.stats()["counters"]["prefill_tokens"] == len(prompt)
    firsts = [pre.handoff.first_token, *(t for t, _ in pre.choice_firsts)]
    children = []
    for i, first in enumerate(firsts):
        blocks = eng.fork_kv(pre.handoff.kv_block_ids, pre.handoff.num_kv_tokens)
        children.append(Request(f"c{i}", prompt, params.for_choice(i), stages={Stage.DECODE},
                                prefilled=PrefilledKV(blocks, len(prompt), first)))
    eng.release("p")
    eng.generate_batch(children)
    assert eng.stats()["counters"]["prefill_tokens"] == len(prompt)  # no prompt token computed again
    alone = [Request(f"a{i}", prompt, params.model_copy(update={"n": 1, "seed": choice_seed(1234, i)}))
             for i in range(3)]
    eng.generate_batch(alone)
    assert [c.output_token_ids for c in children] == [a.output_token_ids for a in alone]
    assert len({tuple(c.output_token_ids) for c in children}) == 3
    assert eng.kv.num_used == 0


async def test_a_stream_interval_changes_how_tokens_are_grouped_not_which(qwen2_vl_dir: Path) -> None:
    """`stream_interval` 3: the same greedy tokens; each stream's first token comes alone,
    the other 9 three at a time (a stream that looks late takes several threes at once)."""
    proc = processor(qwen2_vl_dir)
    cases = make_cases(3)
    expected = _engine(qwen2_vl_dir).generate_batch(
        [to_request(proc, c, f"s{i}", _params(max_tokens=10, ignore_eos=True)) for i, c in enumerate(cases)])
    e = _engine(qwen2_vl_dir, stream_interval=3)

    async def run(req: Request) -> list[list[int]]:
        return [b for b in [[t for o in batch for t in o.new_token_ids]
                            async for batch in e.driver.generate_batches(req, timeout_s=60)] if b]

    try:
        got = await asyncio.gather(*[run(to_request(proc, c, f"s{i}", _params(max_tokens=10, ignore_eos=True)))
                                     for i, c in enumerate(cases)])
    finally:
        e.stop()
    for groups, want in zip(got, expected, strict=True):
        assert [t for g in groups for t in g] == want.output_token_ids
        assert len(groups[0]) == 1 and all(len(g) % 3 == 0 for g in groups[1:]), groups
