"""Logits processors (worker/engine/sampling.py) against scalar reference implementations
of each formula (vLLM's semantics), row by row on the same logits, batched with rows that
use none of them."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from triptych.sampling_params import SamplingParams
from triptych.worker.engine.sampling import SampleRow, apply_min_p, process_logits, sample

VOCAB = 40


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _row(prompt: list[int], output: list[int], stop_ids: frozenset[int] = frozenset(), **kw) -> SampleRow:
    return SampleRow(SamplingParams(max_tokens=64, **kw), None, len(output), prompt_ids=prompt, output_ids=output,
                     stop_ids=stop_ids)


def ref_penalties(logits: list[float], prompt: list[int], output: list[int], rep: float, freq: float,
                  pres: float) -> list[float]:
    """vLLM's formula, one logit at a time."""
    out = []
    for tok, x in enumerate(logits):
        if tok in prompt or tok in output:
            x = x / rep if x > 0 else x * rep
        count = output.count(tok)
        x -= freq * count
        x -= pres * (1.0 if count else 0.0)
        out.append(x)
    return out


PROMPT = [1, 2, 3, 3, 7]
OUTPUT = [3, 9, 9, 9, 12]


@pytest.mark.parametrize(("rep", "freq", "pres"), [
    (1.3, 0.0, 0.0), (0.7, 0.0, 0.0), (1.0, 0.5, 0.0), (1.0, -0.4, 0.0), (1.0, 0.0, 1.5),
    (1.0, 0.0, -1.0), (1.8, 0.9, 0.6),
])
def test_penalties_match_the_reference(rep: float, freq: float, pres: float) -> None:
    logits = _logits(3)
    rows = [_row([5], [5, 6]), _row(PROMPT, OUTPUT, repetition_penalty=rep, frequency_penalty=freq,
                                    presence_penalty=pres), _row(PROMPT, [])]
    got = process_logits(logits, rows)
    want = ref_penalties(logits[1].tolist(), PROMPT, OUTPUT, rep, freq, pres)
    assert got[1].tolist() == pytest.approx(want, rel=1e-6, abs=1e-6)
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])  # untouched rows
    assert got[1].tolist() != logits[1].tolist()


def test_repetition_penalty_only_touches_seen_tokens_and_frequency_only_output() -> None:
    logits = _logits(1, seed=3)
    got = process_logits(logits, [_row(PROMPT, OUTPUT, frequency_penalty=1.0)])[0]
    for tok in range(VOCAB):
        assert got[tok].item() == pytest.approx(logits[0, tok].item() - OUTPUT.count(tok))


def test_logit_bias_adds_and_clamps() -> None:
    logits = _logits(2, seed=1)
    params = SamplingParams(logit_bias={4: 250.0, 5: -3.5, 6: -1000})
    assert params.logit_bias == {4: 100.0, 5: -3.5, 6: -100.0}  # OpenAI's [-100, 100]
    rows = [SampleRow(params, None, 0), _row([], [])]
    got = process_logits(logits, rows)
    want = logits[0].clone()
    want[4] += 100.0
    want[5] -= 3.5
    want[6] -= 100.0
    assert torch.allclose(got[0], want) and torch.equal(got[1], logits[1])
    assert sample(logits, rows).token_ids[0] == 4  # greedy follows the bias


def test_min_tokens_masks_stop_tokens_until_reached() -> None:
    logits = _logits(1, seed=2)
    eos = int(logits[0].argmax())
    stops = frozenset({eos, 11})
    for produced in range(4):
        row = _row([1], [2] * produced, stop_ids=stops, min_tokens=3, temperature=0.0)
        got = process_logits(logits, [row])[0]
        if produced < 3:
            assert got[eos].item() == -math.inf and got[11].item() == -math.inf
            assert sample(logits, [row]).token_ids[0] != eos
        else:
            assert torch.equal(got, logits[0])
            assert sample(logits, [row]).token_ids[0] == eos


def ref_min_p(logits: list[float], min_p: float) -> list[float]:
    exps = [math.exp(x) for x in logits]
    total = sum(exps)
    top = max(exps) / total
    return [x if e / total >= min_p * top else -math.inf for x, e in zip(logits, exps, strict=True)]


@pytest.mark.parametrize("min_p", [0.05, 0.3, 0.9])
def test_min_p_matches_the_reference(min_p: float) -> None:
    logits = _logits(2, seed=4)
    rows = [SampleRow(SamplingParams(min_p=min_p), 1, 0), SampleRow(SamplingParams(), 1, 0)]
    got = apply_min_p(logits, rows)
    want = ref_min_p(logits[0].tolist(), min_p)
    assert [math.isinf(x) for x in got[0].tolist()] == [math.isinf(x) for x in want]
    assert torch.equal(got[1], logits[1])
    # sampled tokens always survive the filter
    for i in range(50):
        tok = sample(logits[:1], [SampleRow(SamplingParams(min_p=min_p), 9, i)]).token_ids[0]
        assert not math.isinf(want[tok])


def test_logprobs_are_of_the_processed_logits() -> None:
    logits = _logits(1, seed=5)
    row = SampleRow(SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3, logit_bias={7: 5.0},
                                   repetition_penalty=1.5), None, 0, prompt_ids=[1, 2], output_ids=[])
    out = sample(logits, [row])
    ref = process_logits(logits, [row]).log_softmax(dim=1)[0]
    entry = out.logprobs[0]
    assert entry["token"] == out.token_ids[0] == int(ref.argmax())
    assert entry["logprob"] == pytest.approx(ref.max().item())
    assert [t for t, _ in entry["top"]] == ref.topk(3).indices.tolist()


@pytest.mark.parametrize("bad", [
    {"presence_penalty": 2.5}, {"frequency_penalty": -2.1}, {"repetition_penalty": 0.0},
    {"min_p": 1.5}, {"min_tokens": -1}, {"min_tokens": 20, "max_tokens": 10}, {"logit_bias": {-1: 1.0}},
    {"top_logprobs": 21},
])
def test_out_of_range_values_are_refused(bad: dict) -> None:
    with pytest.raises(ValidationError):
        SamplingParams(**bad)
