"""Sampling: greedy, filters, and the (seed, output index) keyed random stream."""

from __future__ import annotations

import pytest
import torch

from triptych.sampling_params import SamplingParams
from triptych.worker.engine.sampling import SampleRow, mix_seed, resolve_seed, sample


def _row(index: int = 0, seed: int | None = 7, **kw) -> SampleRow:
    return SampleRow(SamplingParams(**kw), seed, index)


def test_greedy_is_argmax_per_row() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    out = sample(logits, [_row(temperature=0.0, seed=None) for _ in range(5)])
    assert out.token_ids == logits.argmax(dim=1).tolist()
    assert out.logprobs == [None] * 5


def test_seeded_token_does_not_depend_on_batch_composition() -> None:
    gen = torch.Generator().manual_seed(1)
    target = torch.randn(1, 1000, generator=gen)
    alone = sample(target, [_row(index=3, seed=42, temperature=1.0)]).token_ids[0]
    others = torch.randn(6, 1000, generator=gen)
    for pos in range(7):
        batch = torch.cat([others[:pos], target, others[pos:]])
        rows = [_row(index=i, seed=100 + i, temperature=0.8, top_p=0.9) for i in range(6)]
        rows.insert(pos, _row(index=3, seed=42, temperature=1.0))
        assert sample(batch, rows).token_ids[pos] == alone


def test_stream_depends_on_seed_and_index() -> None:
    logits = torch.zeros(1, 5000)  # uniform: every draw is pure noise
    a = [sample(logits, [_row(index=i, seed=1, temperature=1.0)]).token_ids[0] for i in range(20)]
    b = [sample(logits, [_row(index=i, seed=2, temperature=1.0)]).token_ids[0] for i in range(20)]
    again = [sample(logits, [_row(index=i, seed=1, temperature=1.0)]).token_ids[0] for i in range(20)]
    assert a == again
    assert a != b
    assert len(set(a)) > 15  # consecutive indices draw differently


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1, 0.0])
    logits = probs.clamp_min(1e-30).log().unsqueeze(0)
    counts = torch.zeros(4)
    n = 3000
    for i in range(n):
        counts[sample(logits, [_row(index=i, seed=5, temperature=1.0)]).token_ids[0]] += 1
    assert counts[3] == 0
    assert torch.allclose(counts / n, probs, atol=0.03)


def test_temperature_sharpens() -> None:
    logits = torch.tensor([[1.0, 0.0]])
    hot = sum(sample(logits, [_row(index=i, temperature=2.0)]).token_ids[0] for i in range(2000))
    cold = sum(sample(logits, [_row(index=i, temperature=0.2)]).token_ids[0] for i in range(2000))
    assert cold < 50 < hot  # token 1 is rare when cold, common when hot


@pytest.mark.parametrize("kw", [{"top_k": 1}, {"top_p": 0.01}])
def test_top_k_and_top_p_can_force_the_top_token(kw: dict) -> None:
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(3))
    rows = [_row(index=i, temperature=1.5, **kw) for i in range(8)]
    assert sample(logits, rows).token_ids == logits.argmax(dim=1).tolist()


def test_top_k_limits_the_support() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    seen = {sample(logits, [_row(index=i, temperature=2.0, top_k=3)]).token_ids[0] for i in range(500)}
    assert seen == {0, 1, 2}


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().unsqueeze(0)
    seen = {sample(logits, [_row(index=i, temperature=1.0, top_p=0.75)]).token_ids[0] for i in range(500)}
    assert seen == {0, 1}  # 0.5 < 0.75 <= 0.8


def test_logprobs() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    out = sample(logits, [_row(temperature=0.0, seed=None, logprobs=True, top_logprobs=2)])
    lp = logits.log_softmax(dim=1)[0]
    entry = out.logprobs[0]
    assert entry["token"] == 0
    assert entry["logprob"] == pytest.approx(float(lp[0]))
    assert [t for t, _ in entry["top"]] == [0, 1]
    assert entry["top"][1][1] == pytest.approx(float(lp[1]))


def test_seed_resolution() -> None:
    assert resolve_seed(SamplingParams(temperature=0.0)) is None
    assert resolve_seed(SamplingParams(temperature=1.0, seed=9)) == 9
    drawn = {resolve_seed(SamplingParams(temperature=1.0)) for _ in range(5)}
    assert len(drawn) == 5 and all(isinstance(s, int) for s in drawn)


def test_mix_seed_is_a_stable_int64() -> None:
    assert mix_seed(0, 0) == mix_seed(0, 0)
    values = {mix_seed(s, i) for s in (-(2**63), -1, 0, 1, 2**63 - 1) for i in range(100)}
    assert len(values) == 500
    assert all(0 <= v < 2**63 for v in values)
