"""Property-based fuzz of the public API against a real deployment (router + EPD instance
over loopback): whatever hypothesis sends, the answer is never a 5xx, every 4xx carries an
OpenAI error body, and afterwards the server is alive, exact and holds no leaked blocks."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

import httpx
import pytest
import servekit
from hf_reference import make_test_image, png_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from servekit import tiny_dir

pytestmark = pytest.mark.slow

_PNG = "data:image/png;base64," + base64.b64encode(png_bytes(make_test_image(1, 56, 56))).decode()
_junk = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                  st.text(max_size=20), st.lists(st.integers(-5, 10**6), max_size=5), st.dictionaries(
                      st.text(max_size=5), st.integers(), max_size=2))
_text_part = st.builds(lambda t: {"type": "text", "text": t}, st.text(max_size=60))
_image_part = st.builds(lambda u: {"type": "image_url", "image_url": {"url": u}}, st.one_of(
    st.just(_PNG), st.just(_PNG[:80]), st.text(max_size=30).map(lambda t: "data:image/png;base64," + t),
    st.sampled_from(["file:///etc/passwd", "http://127.0.0.1:1/x.png", "data:,", "", "x"])))
_odd_part = st.dictionaries(st.sampled_from(["type", "text", "image_url", "video_url", "foo"]), _junk, max_size=3)
_content = st.one_of(st.text(max_size=80), st.lists(st.one_of(_text_part, _image_part, _odd_part), max_size=4),
                     _junk)
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "developer", "tool", "x"]),
                                  "content": _content})
_knobs = {
    "max_tokens": st.one_of(st.integers(-3, 12), st.integers(10**5, 10**9), _junk),
    "temperature": st.one_of(st.floats(-1, 3), st.just(1e-300), _junk),
    "top_p": st.one_of(st.floats(-0.5, 1.5), _junk), "top_k": st.one_of(st.integers(-2, 100), _junk),
    "seed": st.one_of(st.integers(-2**70, 2**70), _junk), "n": st.one_of(st.integers(-1, 3), _junk),
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=3), max_size=6), _junk),
    "stop_token_ids": st.one_of(st.lists(st.integers(-3, 10**6), max_size=70), _junk),
    "stream": st.one_of(st.booleans(), _junk), "logprobs": _junk, "frobnicate": _junk,
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), _junk),
    "top_logprobs": st.one_of(st.integers(-1, 25), _junk), "best_of": st.one_of(st.integers(-1, 4), _junk),
    "presence_penalty": st.one_of(st.floats(-3, 3), _junk), "frequency_penalty": st.one_of(st.floats(-3, 3), _junk),
    "repetition_penalty": st.one_of(st.floats(-1, 3), _junk), "min_p": st.one_of(st.floats(-0.5, 1.5), _junk),
    "min_tokens": st.one_of(st.integers(-2, 20), _junk),
    "logit_bias": st.one_of(st.dictionaries(st.one_of(st.integers(-5, 10**6).map(str), st.text(max_size=4)),
                                            st.floats(-300, 300), max_size=3), _junk),
    "truncate_prompt_tokens": st.one_of(st.integers(-1, 40), _junk), "chat_template_kwargs": _junk,
}


def _bodies(model: str) -> st.SearchStrategy[object]:
    chat = st.fixed_dictionaries({"model": st.one_of(st.just(model), st.text(max_size=5)),
                                  "messages": st.one_of(st.lists(_message, max_size=3), _junk)},
                                 optional=_knobs)
    return st.one_of(chat, chat, _junk)


def test_public_api_fuzz_no_5xx_then_exact(tmp_path: Path) -> None:
    model = tiny_dir("qwen2-vl")
    with servekit.start(model, "EPD", tmp_path) as dep, httpx.Client(timeout=60) as client:
        url = f"{dep.router_url}/v1/chat/completions"

        @settings(max_examples=150, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(_bodies(model.name))
        def fuzz(body: object) -> None:
            # json.dumps writes NaN/Infinity literals: invalid JSON the server must refuse with a 400.
            r = client.post(url, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
            assert r.status_code < 500, (body, r.status_code, r.text[:300])
            if r.status_code >= 400:
                err = r.json()["error"]
                assert isinstance(err["message"], str) and err["type"], r.text[:300]

        fuzz()
        case = servekit.make_cases(4)[1]  # one image
        got = asyncio.run(servekit.run_all(dep.router_url, [case.openai_body(model.name)]))[0]
        assert got["token_ids"] == servekit.expected_ids(model, case)
        for name, s in servekit.stats_of(dep).items():
            assert s["leases_outstanding"] == 0, name
            for cache in ("kv_cache", "mm_cache"):
                if cache in s:
                    assert s[cache]["referenced"] == 0 if "referenced" in s[cache] else True, (name, s[cache])
