"""`triptych bench throughput`'s request set: seeded, the same for every server; the
long-tailed lengths stay in range and are long-tailed (mean above median)."""

from __future__ import annotations

import statistics

import pytest

from triptych.bench.errors import BenchError
from triptych.bench.throughput import TextLoad


def test_uniform_lengths_and_seeded_prompts() -> None:
    load = TextLoad(kind="uniform", num_requests=8, output_len=128)
    assert load.lengths() == [128] * 8
    assert load.prompts() == TextLoad(kind="uniform", num_requests=8).prompts()
    assert load.prompts() != TextLoad(kind="uniform", num_requests=8, seed=1).prompts()


def test_longtail_lengths_are_clipped_and_skewed() -> None:
    lens = TextLoad(kind="longtail", num_requests=512, min_len=8, max_len=512).lengths()
    assert min(lens) >= 8 and max(lens) <= 512
    assert 8 in lens and 512 in lens  # the clip bites at both ends with sigma 1 over 512 draws
    assert statistics.mean(lens) > statistics.median(lens)
    assert lens == TextLoad(kind="longtail", num_requests=512, min_len=8, max_len=512).lengths()


def test_unknown_workload_is_refused() -> None:
    with pytest.raises(BenchError):
        TextLoad(kind="bursty").lengths()
