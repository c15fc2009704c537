"""Text in the engine: only requests with stop strings (or an engine set to stream text)
are detokenized token by token; the others decode once, when `Request.text` is read."""

from __future__ import annotations

from pathlib import Path

import pytest

from triptych.sampling_params import SamplingParams
from triptych.worker.engine import Engine, EngineConfig, FinishReason, Request

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/worker/conftest.py


def _run(engine: Engine, req: Request) -> list:
    engine.add_request(req)
    outs = []
    while engine.has_work:
        outs += engine.step()
    return outs


def _params(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, **kw)


def test_text_is_decoded_lazily_without_stop_strings_and_streamed_with_them(qwen2_vl_dir: Path) -> None:
    engine = Engine(EngineConfig(model=str(qwen2_vl_dir), num_kv_blocks=32))
    plain = Request("plain", [5, 6, 7, 8, 9], _params())
    outs = _run(engine, plain)
    assert plain.detok is None and all(o.new_text == "" for o in outs)  # nothing detokenized per token
    assert plain.text == engine.tokenizer.decode(plain.output_token_ids, skip_special_tokens=True)
    assert len(plain.text) > 4
    stop = plain.text[2:4]
    cut = Request("cut", [5, 6, 7, 8, 9], _params(stop=[stop]))
    outs = _run(engine, cut)
    assert cut.detok is not None and cut.finish_reason == FinishReason.STOP
    assert "".join(o.new_text for o in outs) == cut.text == plain.text[:plain.text.find(stop)]


def test_engine_set_to_detokenize_streams_the_same_text(qwen2_vl_dir: Path) -> None:
    engine = Engine(EngineConfig(model=str(qwen2_vl_dir), num_kv_blocks=32, detokenize=True))
    req = Request("s", [5, 6, 7, 8, 9], _params())
    outs = _run(engine, req)
    assert req.detok is not None
    assert "".join(o.new_text for o in outs) == req.text == engine.tokenizer.decode(req.output_token_ids,
                                                                                    skip_special_tokens=True)
