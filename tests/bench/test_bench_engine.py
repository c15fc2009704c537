"""`triptych bench engine` runs end to end (tiny model, small settings) and reports JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from triptych.cli import main


@pytest.mark.slow
def test_bench_engine_json(capsys: pytest.CaptureFixture[str], qwen2_vl_dir: Path) -> None:
    before = torch.get_num_threads()
    try:
        assert main(["bench", "engine", "--model", str(qwen2_vl_dir), "--concurrency", "1", "2",
                     "--output-len", "3", "--threads", "1", "--workload-requests", "4", "--workload-concurrency", "2",
                     "--uniform-len", "3", "--longtail-range", "2", "6", "--longtail-median", "3",
                     "--arrival-rate", "20", "--json"]) == 0
    finally:
        torch.set_num_threads(before)
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["speedup_concurrency"] == 2
    work = report["workloads"]
    assert report["speedup_vs_transformers"] == work["uniform"]["speedup"] > 0
    assert report["speedup_vs_transformers_realistic"] == work["longtail"]["speedup"] > 0
    assert report["speedup_vs_transformers_multimodal"] == report["multimodal"]["2"]["speedup"] > 0
    assert work["uniform"]["triptych"]["output_tokens"] == work["uniform"]["transformers generate()"]["output_tokens"] == 12
    lens = work["longtail"]["output_lens"]
    assert 2 <= lens["min"] <= lens["max"] <= 6
    assert work["longtail"]["triptych"]["output_tokens"] == work["longtail"]["transformers generate()"]["output_tokens"] \
        == lens["total"]
    for name in ("uniform", "longtail"):
        assert work[name]["identical_outputs"] == 4  # same greedy tokens as transformers' text LM
        steps = work[name]["triptych"]["steps"]
        assert steps["decode"]["steps"] > 0 and 0 < steps["decode"]["fraction_of_peak"] < 1.5
    assert report["matmul_peak_gflops"] > 0
    for c in ("1", "2"):
        mm = report["multimodal"][c]
        assert mm["triptych"]["output_tokens"] == mm["transformers generate()"]["output_tokens"] == 3 * 4
        assert mm["identical_outputs"] == 4  # same greedy tokens as transformers
        assert set(mm["triptych"]["ttft_ms"]) == {"p50", "p90", "p99", "mean"}
    text = report["text_only"]
    assert "unavailable" in text or all(text[c].get("identical_outputs") == 4 or "error" in text[c]
                                        for c in ("1", "2"))
