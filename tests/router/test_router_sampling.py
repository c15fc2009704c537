"""The router's side of the sampling API (in-process, scripted backend): what reaches the
backend, and n choices / logprobs / best_of / stop strings in OpenAI's response shapes,
streamed and not, read with the official client."""

from __future__ import annotations

import httpx
import pytest
from routerkit import ScriptedBackend, data_url, solid_png

from triptych.router.api import create_app
from triptych.router.backend import GenerationRequest, TokenEvent
from triptych.stage_protocol import TokenLogprob

openai = pytest.importorskip("openai")


def client_for(config, backend, processor) -> openai.AsyncOpenAI:
    app = create_app(config, backend, processor=processor)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router/v1")
    return openai.AsyncOpenAI(api_key="unused", base_url="http://router/v1", http_client=http, max_retries=0)


def lp(token: int, value: float, top: list[tuple[int, float]] | None = None) -> TokenLogprob:
    return TokenLogprob(token=token, logprob=value, top=top or [(token, value)])


def two_choices(processor, texts: tuple[str, str], values: tuple[float, float] = (-0.5, -1.5)):
    """Events for two choices, interleaved token by token, each token with its log-prob."""
    ids = [processor.encode(t) for t in texts]

    def script(req: GenerationRequest) -> list[TokenEvent]:
        events = []
        for step in range(max(map(len, ids))):
            for index, toks in enumerate(ids):
                if step < len(toks):
                    events.append(TokenEvent([toks[step]], index=index,
                                             logprobs=[lp(toks[step], values[index], [(toks[step], values[index]),
                                                                                       (7, -3.0)])]))
        return events + [TokenEvent([], finish_reason="stop", index=i) for i in range(len(ids))]
    return script


async def test_sampling_fields_reach_the_backend(config, processor) -> None:
    backend = ScriptedBackend(script=two_choices(processor, ("a", "b")))
    client = client_for(config, backend, processor)
    await client.chat.completions.create(
        model="tiny-qwen", messages=[{"role": "user", "content": "hi"}], n=2, logprobs=True, top_logprobs=2,
        presence_penalty=0.5, frequency_penalty=-0.25, logit_bias={"11": 300, "12": -5}, seed=3,
        extra_body={"repetition_penalty": 1.2, "min_p": 0.1, "min_tokens": 2, "frobnicate": 1})
    s = backend.requests[0].sampling
    assert (s.n, s.logprobs, s.top_logprobs, s.seed) == (2, True, 2, 3)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_p) == (0.5, -0.25, 1.2, 0.1)
    assert s.logit_bias == {11: 100.0, 12: -5.0} and s.min_tokens == 2


async def test_n_choices_with_logprobs_whole_and_streamed(config, processor) -> None:
    backend = ScriptedBackend(script=two_choices(processor, ("Hello there", "Bye now")))
    client = client_for(config, backend, processor)
    msgs = [{"role": "user", "content": "hi"}]
    resp = await client.chat.completions.create(model="tiny-qwen", messages=msgs, n=2, logprobs=True,
                                                top_logprobs=2)
    assert [(c.index, c.message.content) for c in resp.choices] == [(0, "Hello there"), (1, "Bye now")]
    first = resp.choices[0].logprobs.content
    assert "".join(x.token for x in first) == "Hello there"
    assert [x.logprob for x in first] == [-0.5] * len(first)
    assert [t.logprob for t in first[0].top_logprobs] == [-0.5, -3.0]
    assert bytes(first[0].bytes) == first[0].token.encode()
    n_tokens = len(processor.encode("Hello there")) + len(processor.encode("Bye now"))
    assert resp.usage.completion_tokens == n_tokens

    text = {0: "", 1: ""}
    tokens = {0: 0, 1: 0}
    finish = {}
    async for chunk in await client.chat.completions.create(model="tiny-qwen", messages=msgs, n=2, logprobs=True,
                                                            stream=True):
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
            tokens[c.index] += len(c.logprobs.content) if c.logprobs else 0
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert text == {0: "Hello there", 1: "Bye now"} and finish == {0: "stop", 1: "stop"}
    assert tokens == {0: len(processor.encode("Hello there")), 1: len(processor.encode("Bye now"))}


async def test_a_stop_string_ends_only_its_choice(config, processor) -> None:
    backend = ScriptedBackend(script=two_choices(processor, ("Hello there world", "Bye now friend")))
    client = client_for(config, backend, processor)
    resp = await client.completions.create(model="tiny-qwen", prompt="x", n=2, stop=["there"], max_tokens=50)
    assert [(c.text, c.finish_reason) for c in resp.choices] == [("Hello ", "stop"), ("Bye now friend", "stop")]


async def test_completion_logprobs_shape(config, processor) -> None:
    backend = ScriptedBackend(script=two_choices(processor, ("Hello there", "Bye")))
    client = client_for(config, backend, processor)
    resp = await client.completions.create(model="tiny-qwen", prompt="x", n=2, logprobs=1, max_tokens=50)
    lps = resp.choices[0].logprobs
    assert "".join(lps.tokens) == "Hello there"
    assert lps.token_logprobs == [-0.5] * len(lps.tokens)
    assert lps.text_offset == [sum(len(t) for t in lps.tokens[:i]) for i in range(len(lps.tokens))]
    assert all(top[tok] == -0.5 for top, tok in zip(lps.top_logprobs, lps.tokens, strict=True))


async def test_best_of_returns_the_likeliest_choice(config, processor) -> None:
    backend = ScriptedBackend(script=two_choices(processor, ("Unlikely", "Likely"), values=(-4.0, -0.1)))
    client = client_for(config, backend, processor)
    resp = await client.completions.create(model="tiny-qwen", prompt="x", n=1, best_of=2, max_tokens=50)
    assert [(c.index, c.text) for c in resp.choices] == [(0, "Likely")]
    assert resp.choices[0].logprobs is None  # ranked by log-probs the client did not ask for
    assert backend.requests[0].sampling.n == 2 and backend.requests[0].sampling.logprobs


async def test_truncate_prompt_tokens_keeps_the_tail(config, processor) -> None:
    backend = ScriptedBackend(script=two_choices(processor, ("a", "b")))
    client = client_for(config, backend, processor)
    await client.completions.create(model="tiny-qwen", prompt=list(range(100, 120)), n=2, max_tokens=5,
                                    extra_body={"truncate_prompt_tokens": 5})
    assert backend.requests[0].prompt_token_ids == list(range(115, 120))


async def test_chat_template_kwargs_reach_the_template(config, processor) -> None:
    backend = ScriptedBackend(script=lambda req: [TokenEvent(processor.encode("ok"), finish_reason="stop")])
    client = client_for(config, backend, processor)
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(solid_png())}},
                                         {"type": "text", "text": "What is it?"}]}]
    await client.chat.completions.create(model="tiny-qwen", messages=msgs)
    await client.chat.completions.create(model="tiny-qwen", messages=msgs,
                                         extra_body={"chat_template_kwargs": {"add_vision_id": True}})
    plain, labelled = (processor.decode(r.prompt_token_ids, skip_special_tokens=False) for r in backend.requests)
    assert "Picture 1:" in labelled and "Picture 1:" not in plain
