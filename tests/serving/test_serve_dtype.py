"""`triptych serve --dtype`: every instance runs in the dtype asked for, and a request through
a disaggregated deployment (its KV pulled P -> D in that dtype) gets the tokens the engine
gives in-process in the same dtype."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import servekit
from servekit import tiny_dir

from triptych.cli import build_parser
from triptych.processor import MultimodalProcessor
from triptych.sampling_params import SamplingParams

MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "Tell me a story about three colours."}]}]
MAX_TOKENS = 8


def test_serve_and_bench_serve_take_dtype() -> None:
    parser = build_parser()
    assert parser.parse_args(["serve"]).dtype == "float32"
    assert parser.parse_args(["serve", "--dtype", "bfloat16"]).dtype == "bfloat16"
    assert parser.parse_args(["bench", "serve", "--dtype", "bfloat16"]).dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--dtype", "int8"])


def _in_process_bf16(model: Path) -> list[int]:
    from triptych.worker.engine import Engine, EngineConfig, Request

    ids = MultimodalProcessor.from_pretrained(model).process(MESSAGES, []).token_ids
    engine = Engine(EngineConfig(model=str(model), dtype="bfloat16", num_kv_blocks=32, max_num_seqs=1))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    (done,) = engine.generate_batch([Request("r", ids, params)])
    assert done.error is None
    return list(done.output_token_ids)


@pytest.mark.slow
def test_bf16_deployment_matches_bf16_engine(tmp_path: Path) -> None:
    model = tiny_dir("qwen2-vl")
    body = {"model": model.name, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": True}
    with servekit.start(model, "1P1D", tmp_path, dtype="bfloat16") as dep:
        dtypes = {w.name: httpx.get(f"{w.url}/health", timeout=10).json()["dtype"] for w in dep.workers}
        (got,) = asyncio.run(servekit.run_all(dep.router_url, [body]))
        worker_stats = servekit.stats_of(dep)
    assert dtypes == {"worker-P-0": "bfloat16", "worker-D-0": "bfloat16"}
    assert got["status"] == 200 and not got["error"], got
    assert got["token_ids"] == _in_process_bf16(model)
    # The decode ran on D from a KV pulled off P: the disaggregated path, not a local prefill.
    assert servekit.counter(worker_stats, "prefill_tokens", role="D") == 0
    assert sum(sum(s["transfer_bytes"].values()) for n, s in worker_stats.items() if s["role"] == "D") > 0
