"""The sampling side of the OpenAI API against live multi-process deployments (router +
workers over loopback HTTP and NIXL), through the official `openai` client: logprobs equal
transformers' log-softmax of the same greedy steps, n choices share one prefill, each
penalty gives exactly the tokens of a reference loop applying its formula to
transformers' logits, and bad values are 400s with OpenAI error bodies."""

from __future__ import annotations

import base64
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import servekit
import torch
from hf_reference import hf_inputs, hf_model, make_test_image, png_bytes
from servekit import tiny_dir

from triptych.local import LocalDeployment

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

PROMPT = "Tell me a story about the sea and the stars."
TOL = 2e-4  # fp32 on both sides; different kernels


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_dir("qwen2-vl")


@pytest.fixture(scope="module", params=["EPD", "1E1P1D"])
def dep(request: pytest.FixtureRequest, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[LocalDeployment]:
    with servekit.start(model_dir, request.param, tmp_path_factory.mktemp(request.param)) as d:
        yield d


@pytest.fixture(scope="module")
def client(dep: LocalDeployment) -> openai.OpenAI:
    return openai.OpenAI(api_key="unused", base_url=f"{dep.router_url}/v1", max_retries=0, timeout=120)


def messages(with_image: bool = False) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = [{"type": "text", "text": PROMPT}]
    if with_image:
        content.insert(0, {"type": "image"})
    return [{"role": "user", "content": content}]


def openai_messages(with_image: bool = False) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = [{"type": "text", "text": PROMPT}]
    if with_image:
        content.insert(0, {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(IMAGE_PNG).decode()}})
    return [{"role": "user", "content": content}]


IMAGE = make_test_image(7, 56, 84)
IMAGE_PNG = png_bytes(IMAGE)

Processor = Callable[[torch.Tensor, list[int], list[int]], torch.Tensor]


def reference(model_dir: Path, steps: int, process: Processor | None = None, with_image: bool = False,
              eos: frozenset[int] = frozenset()) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy steps of transformers' model (fp32, the full sequence each step): the tokens
    and each step's log-softmax, after `process(logits, prompt, output)`; stops after a
    token in `eos`."""
    model = hf_model(str(model_dir))
    inputs = hf_inputs(str(model_dir), messages(with_image), [IMAGE] if with_image else [])
    prompt = inputs["input_ids"][0].tolist()
    out: list[int] = []
    lps: list[torch.Tensor] = []
    with torch.inference_mode():
        for _ in range(steps):
            ids = torch.tensor([prompt + out])
            kw = {**inputs, "input_ids": ids, "attention_mask": torch.ones_like(ids)}
            if "mm_token_type_ids" in inputs:  # generated tokens are text
                kw["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"],
                                                     torch.zeros((1, len(out)), dtype=torch.long)], dim=1)
            logits = model(**kw).logits[0, -1].float()
            if process is not None:
                logits = process(logits, prompt, out)
            lps.append(logits.log_softmax(dim=-1))
            out.append(int(logits.argmax()))
            if out[-1] in eos:
                break
    return out, lps


def token_ids(choice: Any) -> list[int]:
    return choice.model_extra["token_ids"]


def prefill_tokens(dep: LocalDeployment) -> int:
    """Prompt tokens prefilled: computed, or found in the prefix cache (a repeated prompt
    is mostly a cache hit, but each prefill still looks its whole prompt up once)."""
    stats = servekit.stats_of(dep)
    return servekit.counter(stats, "prefill_tokens") + servekit.counter(stats, "prefix_cache_hits")


# --- logprobs -------------------------------------------------------------------------------


@pytest.mark.parametrize("with_image", [False, True], ids=["text", "image"])
def test_chat_logprobs_equal_transformers(client: openai.OpenAI, model_dir: Path, with_image: bool) -> None:
    want, lps = reference(model_dir, 6, with_image=with_image)
    body = {"model": model_dir.name, "messages": openai_messages(with_image), "max_tokens": 6, "temperature": 0,
            "logprobs": True, "top_logprobs": 3, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
    resp = client.chat.completions.create(**body)
    choice = resp.choices[0]
    assert token_ids(choice) == want
    content = choice.logprobs.content
    assert len(content) == len(want)
    for item, tok, lp in zip(content, want, lps, strict=True):
        assert item.logprob == pytest.approx(lp[tok].item(), abs=TOL)
        assert bytes(item.bytes) == item.token.encode()
        top = lp.topk(3)
        assert [t.logprob for t in item.top_logprobs] == pytest.approx(top.values.tolist(), abs=TOL)
    assert "".join(c.token for c in content) == choice.message.content

    # Streamed: the same entries, spread over the chunks.
    streamed = []
    for chunk in client.chat.completions.create(**body, stream=True):
        for c in chunk.choices:
            if c.logprobs is not None:
                streamed += c.logprobs.content or []
    assert [c.token for c in streamed] == [c.token for c in content]
    # A repeated prompt is a prefix-cache hit: other batch shapes, the same values up to fp32 rounding.
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=TOL)


def test_completion_logprobs_equal_transformers(client: openai.OpenAI, model_dir: Path) -> None:
    model = hf_model(str(model_dir))
    from triptych.processor import MultimodalProcessor

    proc = MultimodalProcessor.from_pretrained(model_dir)
    prompt = proc.encode(PROMPT)
    out: list[int] = []
    want_lp = []
    with torch.inference_mode():
        for _ in range(5):
            lp = model(input_ids=torch.tensor([prompt + out])).logits[0, -1].float().log_softmax(-1)
            out.append(int(lp.argmax()))
            want_lp.append(lp)
    resp = client.completions.create(model=model_dir.name, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = resp.choices[0]
    assert token_ids(choice) == out
    lp = choice.logprobs
    assert lp.token_logprobs == pytest.approx([w[t].item() for w, t in zip(want_lp, out, strict=True)], abs=TOL)
    assert lp.tokens == [proc.decode([t], skip_special_tokens=False) for t in out]
    offsets = [0]
    for t in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp.text_offset == offsets
    for top, w in zip(lp.top_logprobs, want_lp, strict=True):
        assert sorted(top.values(), reverse=True)[:2] == pytest.approx(w.topk(2).values.tolist(), abs=TOL)


# --- n choices ------------------------------------------------------------------------------


def test_n_greedy_choices_share_one_prefill(dep: LocalDeployment, client: openai.OpenAI, model_dir: Path) -> None:
    want, lps = reference(model_dir, 6)
    num_prompt = len(hf_inputs(str(model_dir), messages(), [])["input_ids"][0])
    servekit.wait_idle(dep)
    before = prefill_tokens(dep)
    resp = client.chat.completions.create(model=model_dir.name, messages=openai_messages(), max_tokens=6,
                                          temperature=0, n=3, logprobs=True,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [token_ids(c) for c in resp.choices] == [want] * 3
    for c in resp.choices:  # each choice's first token's log-prob came with the prefill's hand-over
        assert [x.logprob for x in c.logprobs.content] == pytest.approx(
            [lp[t].item() for lp, t in zip(lps, want, strict=True)], abs=TOL)
    assert resp.usage.completion_tokens == 18 and resp.usage.prompt_tokens == num_prompt
    assert prefill_tokens(dep) - before == num_prompt  # the prompt was computed once
    # Every choice ends with its first token: nothing to fork, nothing left behind.
    short = client.chat.completions.create(model=model_dir.name, messages=openai_messages(), max_tokens=1,
                                           temperature=0, n=2, extra_body={"return_token_ids": True})
    assert [(token_ids(c), c.finish_reason) for c in short.choices] == [(want[:1], "length")] * 2
    servekit.assert_no_leaks(servekit.wait_idle(dep))


def test_n_seeded_choices_stream_like_they_complete(dep: LocalDeployment, client: openai.OpenAI,
                                                    model_dir: Path) -> None:
    body = {"model": model_dir.name, "messages": openai_messages(), "max_tokens": 8, "temperature": 1.0,
            "seed": 1234, "n": 3, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
    before = prefill_tokens(dep)
    whole = client.chat.completions.create(**body)
    ids = [token_ids(c) for c in whole.choices]
    assert len({tuple(x) for x in ids}) == 3  # three seed streams
    single = client.chat.completions.create(**{**body, "n": 1})
    assert token_ids(single.choices[0]) == ids[0]  # choice 0 samples what n=1 does
    streamed: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for chunk in client.chat.completions.create(**body, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.model_extra.get("token_ids") or []
    assert [streamed[i] for i in range(3)] == ids
    assert prefill_tokens(dep) - before == 3 * len(hf_inputs(str(model_dir), messages(), [])["input_ids"][0])
    servekit.assert_no_leaks(servekit.wait_idle(dep))


def test_best_of_returns_the_likeliest(client: openai.OpenAI, model_dir: Path) -> None:
    resp = client.completions.create(model=model_dir.name, prompt=PROMPT, max_tokens=4, temperature=1.0, seed=5,
                                     n=2, best_of=4, logprobs=0, extra_body={"ignore_eos": True})
    assert len(resp.choices) == 2
    scores = [sum(c.logprobs.token_logprobs) for c in resp.choices]
    assert scores[0] >= scores[1]


# --- penalties ------------------------------------------------------------------------------


def vllm_penalties(rep: float, freq: float, pres: float) -> Processor:
    """The formula, written out a token at a time (vLLM's semantics)."""
    def process(logits: torch.Tensor, prompt: list[int], out: list[int]) -> torch.Tensor:
        x = logits.clone()
        for tok in set(prompt) | set(out):
            x[tok] = x[tok] / rep if x[tok] > 0 else x[tok] * rep
        for tok in set(out):
            x[tok] -= freq * out.count(tok) + pres
        return x
    return process


def test_penalties_give_the_reference_tokens(client: openai.OpenAI, model_dir: Path) -> None:
    plain, _ = reference(model_dir, 12)
    want, _ = reference(model_dir, 12, vllm_penalties(1.6, 0.7, 0.4))
    assert want != plain  # the penalties matter on this prompt
    resp = client.chat.completions.create(model=model_dir.name, messages=openai_messages(), max_tokens=12,
                                          temperature=0, frequency_penalty=0.7, presence_penalty=0.4,
                                          extra_body={"repetition_penalty": 1.6, "ignore_eos": True,
                                                      "return_token_ids": True})
    assert token_ids(resp.choices[0]) == want


def test_logit_bias_and_min_tokens_give_the_reference_tokens(client: openai.OpenAI, model_dir: Path) -> None:
    eos_ids = hf_model(str(model_dir)).generation_config.eos_token_id
    eos = eos_ids if isinstance(eos_ids, int) else eos_ids[0]

    def process(logits: torch.Tensor, prompt: list[int], out: list[int]) -> torch.Tensor:
        x = logits.clone()
        x[eos] += 100.0  # the bias clamps to 100
        if len(out) < 3:
            x[eos] = -math.inf
        return x

    want, _ = reference(model_dir, 10, process, eos=frozenset({eos}))
    assert len(want) == 4 and want[-1] == eos
    resp = client.chat.completions.create(model=model_dir.name, messages=openai_messages(), max_tokens=10,
                                          temperature=0, logit_bias={str(eos): 250},
                                          extra_body={"min_tokens": 3, "return_token_ids": True,
                                                      "skip_special_tokens": False})
    assert token_ids(resp.choices[0]) == want and resp.choices[0].finish_reason == "stop"


# --- bad values -----------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"n": -1}, "n"), ({"n": 0}, "n"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"extra_body": {"min_p": -0.1}}, "min_p"),
])
def test_bad_values_are_400s(client: openai.OpenAI, model_dir: Path, kwargs: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=model_dir.name, messages=openai_messages(), **kwargs)
    assert bad.value.status_code == 400
    assert bad.value.body["param"] == param and bad.value.body["type"] == "invalid_request_error"

