"""Tool calling and structured output in the router (router/tools.py, router/structured.py):
Hermes rendering of tools / tool calls / tool results, parsing whole and streamed outputs
into OpenAI tool_calls, and the grammar each request carries to the backend."""

from __future__ import annotations

import json

import httpx
import pytest
from routerkit import ScriptedBackend, reply_events

from triptych.router.api import create_app
from triptych.router.backend import TokenEvent
from triptych.router.protocol import ChatMessage, ToolDef
from triptych.router.tools import ToolCallStream, parse_tool_calls, render_messages

openai = pytest.importorskip("openai")

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def test_render_messages_hermes() -> None:
    msgs = [ChatMessage(role="user", content="Weather in Oslo?"),
            ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}),
            ChatMessage(role="tool", tool_call_id="call_1", content='{"temp": 3}'),
            ChatMessage(role="tool", tool_call_id="call_2", content="cloudy")]
    out = render_messages(msgs, [ToolDef.model_validate(TOOL)])
    assert [m.role for m in out] == ["system", "user", "assistant", "user"]
    assert out[0].content.startswith("You are a helpful assistant.\n\n# Tools")
    assert json.dumps(TOOL) in out[0].content and "<tools>" in out[0].content
    assert out[2].content == CALL_TEXT
    assert out[3].content == '<tool_response>\n{"temp": 3}\n</tool_response>\n<tool_response>\ncloudy\n</tool_response>'
    plain = [ChatMessage(role="user", content="hi")]
    assert render_messages(plain, None) is plain


def test_parse_tool_calls() -> None:
    content, calls = parse_tool_calls("Let me check.\n" + CALL_TEXT + "\n" + CALL_TEXT.replace("Oslo", "Rome"))
    assert content == "Let me check."
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (0, "get_weather", {"city": "Oslo"}), (1, "get_weather", {"city": "Rome"})]
    assert len({c["id"] for c in calls}) == 2
    alone, (call,) = parse_tool_calls(CALL_TEXT)
    assert alone is None and call["function"] == calls[0]["function"]
    broken = "<tool_call>\nnot json\n</tool_call> and <tool_call>{"
    assert parse_tool_calls(broken) == (broken, [])


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_tool_call_stream_matches_whole_parse(step: int) -> None:
    text = "Sure <b>.\n" + CALL_TEXT + "\n" + CALL_TEXT.replace("Oslo", "Rome") + "\n"
    stream, content, calls = ToolCallStream(), "", []
    for i in range(0, len(text), step):
        piece, new = stream.feed(text[i:i + step])
        assert "<tool" not in piece and "</tool" not in piece
        content += piece
        calls += new
    content += stream.finish()
    whole_content, whole_calls = parse_tool_calls(text)
    assert content.strip() == whole_content
    assert [c["function"] for c in calls] == [c["function"] for c in whole_calls]
    assert [c["index"] for c in calls] == [0, 1]
    unclosed = ToolCallStream()
    assert unclosed.feed("a <tool_call>{") == ("a ", [])
    assert unclosed.finish() == "<tool_call>{"


def client_for(config, backend, processor) -> openai.AsyncOpenAI:
    app = create_app(config, backend, processor=processor)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")
    return openai.AsyncOpenAI(api_key="none", base_url="http://router/v1", http_client=http, max_retries=0)


async def test_tool_calls_through_the_client(config, processor) -> None:
    backend = ScriptedBackend(script=lambda req: reply_events(processor, CALL_TEXT, per_event=2))
    client = client_for(config, backend, processor)
    msgs = [{"role": "user", "content": "Weather?"}]
    resp = await client.chat.completions.create(model="tiny-qwen", messages=msgs, tools=[TOOL])
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Oslo"}
    assert backend.requests[-1].grammar is None  # auto: the model decides, nothing is forced

    stream = await client.chat.completions.create(model="tiny-qwen", messages=msgs, tools=[TOOL],
                                                  tool_choice="required", stream=True)
    deltas, finish = [], None
    async for chunk in stream:
        deltas += chunk.choices[0].delta.tool_calls or []
        assert not chunk.choices[0].delta.content
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(deltas) == 1
    assert (deltas[0].index, deltas[0].type, deltas[0].function.name) == (0, "function", "get_weather")
    assert json.loads(deltas[0].function.arguments) == {"city": "Oslo"}
    grammar = backend.requests[-1].grammar
    assert grammar is not None and "<tool_call>" in grammar and "get_weather" in grammar

    none = await client.chat.completions.create(model="tiny-qwen", messages=msgs, tools=[TOOL], tool_choice="none")
    assert none.choices[0].message.content == CALL_TEXT and not none.choices[0].message.tool_calls
    assert none.choices[0].finish_reason == "stop"


async def test_response_format_grammar_reaches_the_backend(config, processor) -> None:
    backend = ScriptedBackend(script=lambda req: reply_events(processor, '{"a": 1}'))
    client = client_for(config, backend, processor)
    msgs = [{"role": "user", "content": "json"}]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    await client.chat.completions.create(model="tiny-qwen", messages=msgs, response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}})
    await client.chat.completions.create(model="tiny-qwen", messages=msgs, response_format={"type": "json_object"})
    await client.completions.create(model="tiny-qwen", prompt="x", extra_body={"response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": schema}}})
    await client.chat.completions.create(model="tiny-qwen", messages=msgs, response_format={"type": "text"})
    grammars = [r.grammar for r in backend.requests]
    assert all(g is not None and '"integer"' in g for g in (grammars[0], grammars[2]))
    assert grammars[1] is not None and '"object"' in grammars[1]
    assert grammars[3] is None


async def test_tool_message_with_an_image_is_400(config, processor, backend) -> None:
    client = client_for(config, backend, processor)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    msgs = [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "c", "content": [image]}]
    with pytest.raises(openai.BadRequestError) as bad:
        await client.chat.completions.create(model="tiny-qwen", messages=msgs, tools=[TOOL])
    assert bad.value.body["param"] == "messages[1].content[0]" and backend.requests == []


async def test_tool_calls_parsed_per_choice_with_n(config, processor) -> None:
    """n > 1 with tools: each choice's text goes through its own parser (whole and streamed),
    so one choice's calls never leak into another's, and each has its own finish_reason."""
    texts = ("Plain answer.", "Checking. " + CALL_TEXT.replace("Oslo", "Rome"))
    ids = [processor.encode(t) + [processor.eos_token_ids[0]] for t in texts]

    def script(req) -> list[TokenEvent]:
        events = [TokenEvent(toks[i:i + 3], index=c) for i in range(0, max(map(len, ids)), 3)
                  for c, toks in enumerate(ids) if i < len(toks)]  # the choices interleaved
        return events + [TokenEvent([], finish_reason="stop", index=c) for c in range(len(ids))]

    backend = ScriptedBackend(script=script)
    client = client_for(config, backend, processor)
    msgs = [{"role": "user", "content": "Weather?"}]
    resp = await client.chat.completions.create(model="tiny-qwen", messages=msgs, tools=[TOOL], n=2)
    plain, called = sorted(resp.choices, key=lambda c: c.index)
    assert (plain.message.content, plain.message.tool_calls, plain.finish_reason) == ("Plain answer.", None, "stop")
    assert called.message.content == "Checking." and called.finish_reason == "tool_calls"
    assert [json.loads(c.function.arguments) for c in called.message.tool_calls] == [{"city": "Rome"}]
    assert backend.requests[-1].sampling.n == 2

    stream = await client.chat.completions.create(model="tiny-qwen", messages=msgs, tools=[TOOL], n=2,
                                                  stream=True)
    content, calls, finish = ["", ""], [[], []], [None, None]
    async for chunk in stream:
        for c in chunk.choices:
            content[c.index] += c.delta.content or ""
            calls[c.index] += c.delta.tool_calls or []
            finish[c.index] = c.finish_reason or finish[c.index]
    assert content[0] == "Plain answer." and calls[0] == [] and finish[0] == "stop"
    assert "<tool_call>" not in content[1] and content[1].strip() == "Checking." and finish[1] == "tool_calls"
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in calls[1]] == [
        (0, "get_weather", {"city": "Rome"})]
