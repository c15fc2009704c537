"""The model runner on its own: batch inputs (positions for RoPE and M-RoPE chunks,
embedding scatter into placeholder spans), one batched forward against single-sequence
runs, and which rows are sampled."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from engine_cases import Item, make_cases, processor, to_request

from triptych.sampling_params import SamplingParams
from triptych.worker.engine.batch import Chunk
from triptych.worker.engine.kv_cache import KVCache
from triptych.worker.engine.mm_cache import MMCache
from triptych.worker.engine.model_runner import (
    ModelRunner,
    batch_token_ids,
    chunk_positions,
    sample_rows,
    scatter_embeddings,
)
from triptych.worker.engine.request import Request
from triptych.worker.models.loader import load_model
from triptych.worker.models.rope import prompt_positions

GREEDY = SamplingParams(temperature=0.0)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/worker/conftest.py


def _req(rid: str, prompt: list[int], outputs: list[int] = (), delta: int = 0, mrope: bool = False,
         mm_items: list[Item] = ()) -> Request:
    req = Request(rid, prompt, GREEDY, mm_items=mm_items)
    req.output_token_ids = list(outputs)
    n = len(prompt)
    # Distinct per-axis values, so a slice taken from the wrong place shows.
    req.positions = torch.stack([torch.arange(n) * (a + 1) + 100 * a for a in range(3)]) if mrope else torch.arange(n)
    req.rope_delta = delta
    return req


# --- positions -------------------------------------------------------------------------------

@pytest.mark.parametrize("mrope", [False, True])
def test_positions_of_prefill_decode_and_recompute_chunks(mrope: bool) -> None:
    a = _req("a", [5] * 5, delta=-2, mrope=mrope)  # a prefill chunk inside the prompt
    b = _req("b", [5] * 5, [1, 2, 3], delta=-2, mrope=mrope)  # decodes: token index + delta
    c = _req("c", [5] * 4, [1, 2], delta=3, mrope=mrope)
    d = _req("d", [5] * 5, [1, 2, 3], delta=4, mrope=mrope)  # recompute after preemption: prompt + outputs
    chunks = [Chunk(a, 0, 3), Chunk(b, 7, 8), Chunk(c, 5, 6), Chunk(d, 3, 8)]
    got = chunk_positions(chunks, mrope)

    def gen(start: int, end: int, delta: int) -> torch.Tensor:
        t = torch.arange(start + delta, end + delta)
        return t.expand(3, -1) if mrope else t

    want = torch.cat([a.positions[..., 0:3], gen(7, 8, -2), gen(5, 6, 3), d.positions[..., 3:5], gen(5, 8, 4)],
                     dim=-1)
    assert got.shape == ((3, 10) if mrope else (10,))
    assert torch.equal(got, want)


def test_token_ids_follow_the_chunks() -> None:
    a = _req("a", [10, 11, 12, 13])
    b = _req("b", [20, 21], [22, 23])
    d = _req("d", [30, 31, 32], [33, 34])
    assert batch_token_ids([Chunk(a, 1, 3), Chunk(b, 3, 4), Chunk(d, 2, 5)]) == [11, 12, 23, 32, 33, 34]


# --- embedding scatter --------------------------------------------------------------------------

def test_embeddings_land_on_their_placeholder_rows_across_a_chunk_cut() -> None:
    hidden = 4
    mm = MMCache(num_blocks=8, rows_per_block=3, hidden_size=hidden, dtype=torch.float32, device="cpu",
                 shuffle_seed=5)
    entry = mm.allocate("img", 5)
    image = torch.arange(1, 6, dtype=torch.float32).unsqueeze(1).expand(5, hidden) * 10
    mm.write(entry, image)
    mm.commit(entry)
    prompt = [1, 2] + [9] * 5 + [3, 4]  # image span [2, 7)
    first, second = (_req(r, prompt, mm_items=[Item(2, 5, "img")]) for r in ("p", "q"))
    first.mm_entries[0] = second.mm_entries[0] = entry
    text = _req("t", [1, 2, 3])
    # first: tokens [0, 4) (the cut falls inside the image), text: [0, 3), second: [4, 9)
    chunks = [Chunk(first, 0, 4), Chunk(text, 0, 3), Chunk(second, 4, 9)]
    embeds = torch.full((12, hidden), -1.0)
    scatter_embeddings(embeds, chunks, mm)
    expect = torch.full((12, hidden), -1.0)
    expect[2:4] = image[0:2]  # first's rows 2, 3 = image rows 0, 1
    expect[7:10] = image[2:5]  # second's rows 4, 5, 6 (batch rows 7..9) = image rows 2..4
    assert torch.equal(embeds, expect)


# --- which rows are sampled -----------------------------------------------------------------------

def test_the_last_row_of_each_chunk_that_ends_its_sequence_is_sampled() -> None:
    a = _req("a", [5] * 6)  # chunk stops short of the end: not sampled
    b = _req("b", [5] * 3, [1])
    c = _req("c", [5] * 5)
    chunks = [Chunk(a, 0, 3), Chunk(b, 3, 4), Chunk(c, 0, 5)]
    rows, sampling = sample_rows(chunks)
    assert rows == [3, 8] and [ch.req for ch in sampling] == [b, c]


# --- the forward: batched equals one sequence at a time ------------------------------------------

def _runner(model, blocks: int = 64) -> ModelRunner:
    spec = model.spec
    kv = KVCache(num_blocks=blocks, num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
                 head_dim=spec.head_dim, block_size=4, dtype=torch.float32, device="cpu", shuffle_seed=3)
    mm = MMCache(num_blocks=64, rows_per_block=8, hidden_size=spec.hidden_size, dtype=torch.float32, device="cpu")
    return ModelRunner(model, kv, mm, torch.device("cpu"), threading.RLock())


def _prepare(runner: ModelRunner, reqs: list[Request], embeddings: dict[str, torch.Tensor]) -> None:
    """What admission and the scheduler would have done: positions, KV blocks, MM entries."""
    for req in reqs:
        req.positions, req.rope_delta = prompt_positions(runner.spec, req.prompt_token_ids, req.mm_items)
        req.block_ids = runner.kv.allocate(runner.kv.blocks_for(req.num_prompt_tokens + 2))
        for i, item in enumerate(req.mm_items):
            entry = runner.mm.acquire(item.content_hash)
            if entry is None:
                entry = runner.mm.allocate(item.content_hash, item.length)
                runner.mm.write(entry, embeddings[item.content_hash])
                runner.mm.commit(entry)
            req.mm_entries[i] = entry


def _logits(runner: ModelRunner, chunks: list[Chunk]) -> dict[str, torch.Tensor]:
    hidden = runner.forward(chunks)
    rows, sampling = sample_rows(chunks)
    logits = runner.language.logits(hidden[torch.tensor(rows)])
    return {c.req.request_id: logits[i] for i, c in enumerate(sampling)}


def test_batched_forward_equals_single_sequence_runs(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir, vision=False, language=True, dtype=torch.float32, device="cpu")
    proc = processor(tiny_model_dir)
    cases = make_cases(4)
    gen = torch.Generator().manual_seed(0)

    def fresh() -> list[Request]:
        return [to_request(proc, cases[i], f"r{i}") for i in (0, 2, 1)]  # text, two images, one image

    embeddings = {it.content_hash: torch.randn(it.length, model.spec.hidden_size, generator=gen) * 0.02
                  for req in fresh() for it in req.mm_items}
    batched, batch_runner = fresh(), _runner(model)
    _prepare(batch_runner, batched, embeddings)
    a, b, c = batched
    cut = b.mm_items[0].offset + 2  # b's prompt is split inside its first image
    step1 = _logits(batch_runner, [Chunk(a, 0, a.num_prompt_tokens), Chunk(b, 0, cut),
                                   Chunk(c, 0, c.num_prompt_tokens)])
    assert set(step1) == {"r0", "r1"}  # b's chunk ends mid-prompt: nothing sampled
    for r in (a, c):
        r.output_token_ids.append(7)
    step2 = _logits(batch_runner, [Chunk(a, a.num_prompt_tokens, a.num_tokens),
                                   Chunk(b, cut, b.num_prompt_tokens), Chunk(c, c.num_prompt_tokens, c.num_tokens)])

    for req in fresh():
        runner = _runner(model)
        _prepare(runner, [req], embeddings)
        prompt = _logits(runner, [Chunk(req, 0, req.num_prompt_tokens)])[req.request_id]
        if req.request_id == "r2":
            torch.testing.assert_close(step2["r2"], prompt, rtol=1e-4, atol=1e-5)
            continue
        torch.testing.assert_close(step1[req.request_id], prompt, rtol=1e-4, atol=1e-5)
        req.output_token_ids.append(7)
        decode = _logits(runner, [Chunk(req, req.num_prompt_tokens, req.num_tokens)])[req.request_id]
        torch.testing.assert_close(step2[req.request_id], decode, rtol=1e-4, atol=1e-5)
    assert b.mm_items and len(b.mm_items) == 2


def test_sampling_takes_the_argmax_of_each_sampled_row(qwen2_vl_dir: Path) -> None:
    model = load_model(qwen2_vl_dir, vision=False, language=True, dtype=torch.float32, device="cpu")
    runner = _runner(model)
    reqs = [Request(f"s{i}", list(range(3 + i, 12 + 2 * i)), GREEDY) for i in range(3)]
    _prepare(runner, reqs, {})
    chunks = [Chunk(reqs[0], 0, reqs[0].num_prompt_tokens), Chunk(reqs[1], 0, 4),
              Chunk(reqs[2], 0, reqs[2].num_prompt_tokens)]
    logits = _logits(runner, chunks)
    for req in reqs:  # the forward again, into fresh blocks: it must give the same answer
        runner.kv.free(req.block_ids)
        req.block_ids = runner.kv.allocate(runner.kv.blocks_for(req.num_prompt_tokens + 2))
    sampled = runner.run_language(chunks)
    assert set(sampled) == {id(reqs[0]), id(reqs[2])}
    for req in (reqs[0], reqs[2]):
        assert sampled[id(req)] == (int(logits[req.request_id].argmax()), None)
