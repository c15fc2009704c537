"""`triptych bench serve --trace`: the request bodies a trace line becomes, re-timing, and
the replay end to end against a local deployment."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest
from PIL import Image

from triptych.bench.trace import PromptScale, timed, trace_bodies
from triptych.cli import main
from triptych.operator.planner.workload import TraceRequest, write_trace

TRACE = [TraceRequest(t=1.0, images=[(64, 48), (32, 32)], prompt_tokens=50, output_tokens=4),
         TraceRequest(t=1.5, images=[], prompt_tokens=120, output_tokens=7),
         TraceRequest(t=3.0, images=[(40, 40)], prompt_tokens=10, output_tokens=1)]


def test_trace_lines_become_bodies_of_their_shape() -> None:
    bodies = [json.loads(b) for b in trace_bodies(TRACE, "m", seed=0, scale=PromptScale(tokens_per_word=2.5))]
    assert [b["max_tokens"] for b in bodies] == [4, 7, 1]
    assert all(b["ignore_eos"] and b["stream"] and b["temperature"] == 0 for b in bodies)
    sizes, words = [], []
    for b in bodies:
        parts = b["messages"][0]["content"]
        sizes.append([Image.open(io.BytesIO(base64.b64decode(p["image_url"]["url"].split(",", 1)[1]))).size
                      for p in parts if p["type"] == "image_url"])
        words.append(len(parts[-1]["text"].split()))
    assert sizes == [[(64, 48), (32, 32)], [], [(40, 40)]]
    assert words == [20, 48, 4]  # prompt_tokens / 2.5 tokens per word


def test_replay_times_start_at_zero_and_re_time_keeps_the_shape() -> None:
    assert [r.t for r in timed(TRACE, None)] == [0.0, 0.5, 2.0]
    # mean rate 1 req/s (2 gaps over 2 s) -> 2 req/s halves every gap
    assert [r.t for r in timed(TRACE, 2.0)] == pytest.approx([0.0, 0.25, 1.0])


@pytest.mark.slow
def test_bench_serve_replays_a_trace_against_a_local_deployment(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "trace.jsonl"
    write_trace(path, TRACE)
    argv = ["bench", "serve", "--topologies", "EPD", "--trace", str(path), "--transfer-require", "any",
            "--idle-seconds", "0", "--warmup", "0", "--json"]
    assert main(argv) == 0
    rep = json.loads(capsys.readouterr().out)["topologies"]["EPD"]
    assert (rep["num_requests"], rep["completed"], rep["failed"]) == (3, 3, 0)
    assert rep["rates"][0]["rate"] == pytest.approx(1.0)  # the trace's own mean rate
    assert rep["output_tokens_per_s"] * rep["duration_s"] == pytest.approx(4 + 7 + 1)  # ignore_eos
    scale = rep["prompt_scale"]
    assert scale["tokens_per_word"] > 1 and scale["template_tokens"] > 0  # the tiny tokenizer splits words
