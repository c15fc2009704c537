"""Structured output and tool calling through the official `openai` client against live
multi-process deployments (1E1P1D: the grammar masks P's first token and D's decode;
EPD: one instance). The model has random weights, so only a grammar can make its output
valid JSON: every sample must parse and validate."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator

import jsonschema
import pytest
import servekit
from hf_reference import make_test_image, png_bytes

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

FAMILY = "qwen2-vl"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                       "required": ["city", "days"], "additionalProperties": False},
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module", params=["1E1P1D", "EPD"])
def deployment(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    model = servekit.tiny_dir(FAMILY)
    with servekit.start(model, request.param, tmp_path_factory.mktemp(request.param)) as dep:
        yield dep, model.name


def client(dep) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(api_key="none", base_url=f"{dep.router_url}/v1", max_retries=0, timeout=120)


def image_message(text: str) -> dict:
    import base64

    url = "data:image/png;base64," + base64.b64encode(png_bytes(make_test_image(3, 56, 56))).decode()
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                        {"type": "text", "text": text}]}


def test_json_schema_100_seeded_samples_validate(deployment) -> None:
    dep, model = deployment
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}

    async def one(c: openai.AsyncOpenAI, seed: int):
        # Every 4th sample carries an image: E encodes, P prefills (first token masked), D decodes.
        messages = [image_message("Who is it?") if seed % 4 == 0 else {"role": "user", "content": "A person."}]
        return await c.chat.completions.create(model=model, messages=messages, temperature=1, seed=seed,
                                               max_tokens=80, response_format=fmt)

    async def run() -> list:
        c = client(dep)
        return await asyncio.gather(*(one(c, s) for s in range(100)))

    replies = asyncio.run(run())
    texts = set()
    for seed, r in enumerate(replies):
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (seed, choice)
        value = json.loads(choice.message.content)
        jsonschema.validate(value, SCHEMA)
        texts.add(choice.message.content)
    assert len(texts) > 10  # seeds sample different valid objects, not one forced string


def test_json_schema_stream_and_completions(deployment) -> None:
    dep, model = deployment
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}

    async def run() -> tuple[str, str | None, str]:
        c = client(dep)
        stream = await c.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],
                                                 seed=7, max_tokens=80, response_format=fmt, stream=True)
        text, finish = "", None
        async for chunk in stream:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        done = await c.completions.create(model=model, prompt="Person:", seed=3, max_tokens=80,
                                          extra_body={"response_format": fmt})
        return text, finish, done.choices[0].text

    text, finish, completion = asyncio.run(run())
    assert finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    jsonschema.validate(json.loads(completion), SCHEMA)


def test_json_object(deployment) -> None:
    """`json_object` allows any object: a random model rarely closes its strings within
    max_tokens, so each sample either stops as a parsed object or is cut at length, and
    starts as an object either way."""
    dep, model = deployment

    async def run() -> list:
        c = client(dep)
        return await asyncio.gather(*(c.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "json"}], temperature=1, seed=s, max_tokens=24,
            response_format={"type": "json_object"}) for s in range(8)))

    for r in asyncio.run(run()):
        choice = r.choices[0]
        assert choice.message.content.startswith("{"), choice
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:
            assert choice.finish_reason == "length"


def test_vllm_guided_fields(deployment) -> None:
    """vLLM's `structured_outputs` and older `guided_*` fields constrain the same way (the
    first token on P, the rest on D in 1E1P1D): seeded samples, each within the constraint."""
    dep, model = deployment
    colors = ["red", "green", "dark blue"]
    regex = r"[0-9]{2}-[a-z]{3}"

    async def run() -> tuple[list, list, list]:
        c = client(dep)
        msgs = [{"role": "user", "content": "Pick one."}]
        picked = await asyncio.gather(*(c.chat.completions.create(
            model=model, messages=msgs, temperature=1, seed=s, max_tokens=16,
            extra_body={"structured_outputs": {"choice": colors}} if s % 2 else {"guided_choice": colors})
            for s in range(12)))
        codes = await asyncio.gather(*(c.completions.create(
            model=model, prompt="Code:", temperature=1, seed=s, max_tokens=16,
            extra_body={"guided_regex": regex} if s % 2 else {"structured_outputs": {"regex": regex}})
            for s in range(12)))
        flags = await asyncio.gather(*(c.chat.completions.create(
            model=model, messages=msgs, temperature=1, seed=s, max_tokens=8,
            extra_body={"guided_json": {"type": "boolean"}}) for s in range(4)))
        return picked, codes, flags

    picked, codes, flags = asyncio.run(run())
    assert all(r.choices[0].message.content in colors and r.choices[0].finish_reason == "stop" for r in picked)
    assert all(re.fullmatch(regex, r.choices[0].text) and r.choices[0].finish_reason == "stop" for r in codes)
    assert len({r.choices[0].text for r in codes}) > 1  # sampled, not forced to one string
    assert all(r.choices[0].message.content in ("true", "false") for r in flags)


def test_tool_call_round_trip_streams(deployment) -> None:
    dep, model = deployment
    messages: list = [{"role": "user", "content": "What is the weather in Paris?"}]

    async def run() -> tuple:
        c = client(dep)
        # Required: the grammar forces one valid call; streamed deltas, assembled by the client.
        async with c.beta.chat.completions.stream(model=model, messages=messages, tools=[WEATHER, CLOCK],
                                                  tool_choice="required", seed=1, max_tokens=64) as stream:
            async for _ in stream:
                pass
            streamed = await stream.get_final_completion()
        # The same request unstreamed gives the same call (seeded).
        plain = await c.chat.completions.create(model=model, messages=messages, tools=[WEATHER, CLOCK],
                                                tool_choice="required", seed=1, max_tokens=64)
        named = await c.chat.completions.create(
            model=model, messages=messages, tools=[WEATHER, CLOCK], seed=2, max_tokens=64,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        call = plain.choices[0].message.tool_calls[0]
        history = [*messages, plain.choices[0].message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 21})}]
        final = await c.chat.completions.create(model=model, messages=history, tools=[WEATHER, CLOCK],
                                                seed=3, max_tokens=12, stream=True)
        text, finish = "", None
        async for chunk in final:
            assert not chunk.choices[0].delta.tool_calls
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        return streamed, plain, named, text, finish

    streamed, plain, named, text, finish = asyncio.run(run())
    for reply in (streamed, plain, named):
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert not choice.message.content
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        tool = {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert named.choices[0].message.tool_calls[0].function.name == "get_weather"
    s_call, p_call = streamed.choices[0].message.tool_calls[0], plain.choices[0].message.tool_calls[0]
    assert (s_call.function.name, s_call.function.arguments) == (p_call.function.name, p_call.function.arguments)
    assert finish in ("stop", "length") and isinstance(text, str)


def test_bad_schemas_are_400(deployment) -> None:
    dep, model = deployment
    msg = [{"role": "user", "content": "x"}]
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}

    async def run() -> list:
        c = client(dep)
        errors = []
        for kwargs in (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
            {"response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "string", "pattern": "(unclosed"}}}},
            {"tools": [bad_tool]},
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        ):
            with pytest.raises(openai.BadRequestError) as bad:
                await c.chat.completions.create(model=model, messages=msg, max_tokens=4, **kwargs)
            errors.append(bad.value)
        return errors

    for err in asyncio.run(run()):
        assert err.status_code == 400
        assert err.body["type"] == "invalid_request_error" and err.body["message"] and err.body["param"], err.body


def test_n_choices_each_follow_the_grammar(deployment) -> None:
    """n > 1 with response_format and with a forced tool_choice: one prefill samples every
    choice's first token under the grammar, each forked choice decodes under a matcher
    replayed from its own tokens, and the router parses each choice's tool call on its own."""
    dep, model = deployment
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    msg = [{"role": "user", "content": "A person."}]

    async def run() -> tuple:
        c = client(dep)
        whole = await c.chat.completions.create(model=model, messages=msg, n=4, temperature=1, seed=5,
                                                max_tokens=80, response_format=fmt)
        stream = await c.chat.completions.create(model=model, messages=msg, n=3, temperature=1, seed=6,
                                                 max_tokens=80, response_format=fmt, stream=True)
        streamed = ["", "", ""]
        async for chunk in stream:
            for ch in chunk.choices:
                streamed[ch.index] += ch.delta.content or ""
        tools = await c.chat.completions.create(model=model, messages=msg, n=2, temperature=1, seed=7,
                                                max_tokens=64, tools=[WEATHER], tool_choice="required")
        return whole, streamed, tools

    whole, streamed, tools = asyncio.run(run())
    assert sorted(ch.index for ch in whole.choices) == [0, 1, 2, 3]
    for ch in whole.choices:
        assert ch.finish_reason == "stop", ch
        jsonschema.validate(json.loads(ch.message.content), SCHEMA)
    assert len({ch.message.content for ch in whole.choices}) > 1  # own seed streams, not one copy
    for text in streamed:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(tools.choices) == 2
    for ch in tools.choices:
        assert ch.finish_reason == "tool_calls" and not ch.message.content, ch
        (call,) = ch.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
