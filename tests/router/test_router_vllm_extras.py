"""vLLM's request extras beyond OpenAI's fields, at the router (scripted backend): guided
decoding (`structured_outputs` and the older `guided_*` fields) as the grammar each request
carries, `include_stop_str_in_output`, `return_tokens_as_token_ids`, `echo`, and
`add_generation_prompt` / `continue_final_message` against transformers' chat template.
The extras we know but do not implement are 400s (tests/router/test_router_errors.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hf_reference import hf_processor
from routerkit import REPLY, ScriptedBackend, chat_body, parse_sse, reply_events
from test_router_errors import assert_openai_error

from triptych.router.backend import GenerationRequest, TokenEvent
from triptych.stage_protocol import TokenLogprob
from triptych.worker.engine.guided import GuideTokenizer

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def completion_body(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny-qwen", "prompt": "Say hello", **extra}


def accepts(processor, grammar: str, text: str) -> bool:
    """Whether `grammar` lets a model write exactly `text` (token by token, then stop)."""
    tokens = GuideTokenizer(processor.model_dir / "tokenizer.json", processor.vocab_size,
                            processor.eos_token_ids)
    guide = tokens.matcher(grammar)
    return all(guide.advance(t) for t in processor.encode(text)) and guide.matcher.is_accepting()


BOOLEAN = {"type": "boolean"}
GUIDED = [
    # (id, fields, texts the grammar must accept, texts it must refuse)
    ("guided_choice", {"guided_choice": ["yes", "no way", 'a "quoted" \\ one']},
     ["yes", "no way", 'a "quoted" \\ one'], ["maybe", "yes no", "no"]),
    ("structured_outputs.choice", {"structured_outputs": {"choice": ["red", "green"]}}, ["red", "green"], ["blue"]),
    ("guided_regex", {"guided_regex": "[0-9]{3}-[a-z]{2}"}, ["123-ab"], ["12-ab", "123-abc", "123ab"]),
    ("structured_outputs.regex", {"structured_outputs": {"regex": "(ab)+c"}}, ["abc", "ababc"], ["ac", "abcc"]),
    ("guided_json object", {"guided_json": BOOLEAN}, ["true", "false"], ["1", "yes"]),
    ("guided_json text", {"guided_json": json.dumps(BOOLEAN)}, ["true"], ["null"]),
    ("structured_outputs.json", {"structured_outputs": {"json": {"type": "object", "properties": {
        "x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}}}, ['{"x":5}'], ['{"y":5}']),
    ("structured_outputs.json_object", {"structured_outputs": {"json_object": True}}, ['{"a":[1]}'], ["[1]"]),
    ("guided_grammar", {"guided_grammar": 'start: "A" ("B" | "C")+'}, ["AB", "ACBC"], ["A", "AD"]),
    ("structured_outputs.grammar", {"structured_outputs": {"grammar": 'start: "x"'}}, ["x"], ["y"]),
]


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
@pytest.mark.parametrize(("fields", "good", "bad"), [c[1:] for c in GUIDED], ids=[c[0] for c in GUIDED])
async def test_guided_fields_become_the_requests_grammar(client, backend, processor, endpoint, fields,
                                                         good, bad) -> None:
    body = chat_body(**fields) if endpoint == CHAT else completion_body(**fields)
    r = await client.post(endpoint, json=body)
    assert r.status_code == 200, r.text
    grammar = backend.requests[-1].grammar
    assert grammar is not None
    assert all(accepts(processor, grammar, t) for t in good), good
    assert not any(accepts(processor, grammar, t) for t in bad), bad


async def test_guided_fields_are_refused_beside_another_constraint_on_completions(client, backend) -> None:
    r = await client.post(COMPLETIONS, json=completion_body(guided_json=BOOLEAN,
                                                            response_format={"type": "json_object"}))
    assert_openai_error(r, 400, param="guided_json", contains="cannot be combined with response_format")
    r = await client.post(COMPLETIONS, json=completion_body(structured_outputs={"regex": "a", "choice": ["b"]}))
    assert_openai_error(r, 400, param="structured_outputs.choice", contains="only one kind")
    r = await client.post(COMPLETIONS, json=completion_body(echo=True, logprobs=1))
    assert_openai_error(r, 400, param="echo", contains="logprobs")
    assert backend.requests == []


def stop_backend(processor) -> ScriptedBackend:
    return ScriptedBackend(script=lambda req: reply_events(processor, "Hello there. Bye now."))


async def test_include_stop_str_in_output(make_client, config, processor) -> None:
    async with make_client(config, stop_backend(processor)) as client:
        for include, text in ((False, "Hello there"), (True, "Hello there.")):
            body = completion_body(stop=["."], include_stop_str_in_output=include)
            r = await client.post(COMPLETIONS, json=body)
            choice = r.json()["choices"][0]
            assert (choice["text"], choice["finish_reason"]) == (text, "stop")
            r = await client.post(COMPLETIONS, json=body | {"stream": True})
            chunks = [c for c in parse_sse(r.text) if c != "[DONE]"]
            assert "".join(c["choices"][0]["text"] for c in chunks) == text


def logprob_backend(processor) -> ScriptedBackend:
    def script(req: GenerationRequest) -> list[TokenEvent]:
        ids = processor.encode("Hi there")
        return [TokenEvent([t], logprobs=[TokenLogprob(token=t, logprob=-0.5, top=[(t, -0.5), (7, -2.0)])],
                           finish_reason="length" if k == len(ids) - 1 else None) for k, t in enumerate(ids)]
    return ScriptedBackend(script=script)


async def test_return_tokens_as_token_ids(make_client, config, processor) -> None:
    ids = processor.encode("Hi there")
    async with make_client(config, logprob_backend(processor)) as client:
        r = await client.post(CHAT, json=chat_body(logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True))
        content = r.json()["choices"][0]["logprobs"]["content"]
        assert [e["token"] for e in content] == [f"token_id:{t}" for t in ids]
        assert content[0]["top_logprobs"][1]["token"] == "token_id:7"
        assert content[0]["bytes"] == list(f"token_id:{ids[0]}".encode())
        r = await client.post(COMPLETIONS, json=completion_body(logprobs=1, return_tokens_as_token_ids=True))
        lp = r.json()["choices"][0]["logprobs"]
        assert lp["tokens"] == [f"token_id:{t}" for t in ids]
        assert set(lp["top_logprobs"][0]) == {f"token_id:{ids[0]}", "token_id:7"}
        assert r.json()["choices"][0]["text"] == "Hi there"  # the text itself is unchanged
        r = await client.post(CHAT, json=chat_body(logprobs=True))  # off: the tokens' own text
        assert "".join(e["token"] for e in r.json()["choices"][0]["logprobs"]["content"]) == "Hi there"


async def test_echo_on_completions_returns_the_prompt_first(client, processor) -> None:
    r = await client.post(COMPLETIONS, json=completion_body(echo=True))
    assert r.json()["choices"][0]["text"] == "Say hello" + REPLY
    r = await client.post(COMPLETIONS, json=completion_body(echo=True, stream=True))
    chunks = [c for c in parse_sse(r.text) if c != "[DONE]"]
    assert chunks[0]["choices"][0]["text"] == "Say hello"
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Say hello" + REPLY
    ids = processor.encode("Tell me more")
    r = await client.post(COMPLETIONS, json=completion_body(prompt=ids, echo=True))
    assert r.json()["choices"][0]["text"] == "Tell me more" + REPLY  # token ids: detokenized
    r = await client.post(COMPLETIONS, json=completion_body(echo=True, truncate_prompt_tokens=1))
    assert r.json()["choices"][0]["text"] == processor.decode(processor.encode("Say hello")[-1:], False) + REPLY


ASSISTANT_LAST = [{"role": "user", "content": "What is 2 + 2?"},
                  {"role": "assistant", "content": [{"type": "text", "text": "The answer is"}]}]


def n_replies(processor) -> ScriptedBackend:
    """The default reply for each of the request's n choices."""
    def script(req: GenerationRequest) -> list[TokenEvent]:
        return [TokenEvent(e.token_ids, e.finish_reason, index=i)
                for i in range(req.sampling.n) for e in reply_events(processor)]
    return ScriptedBackend(script=script)


async def test_echo_on_chat_repeats_a_last_message_of_the_replys_role(make_client, config, processor) -> None:
    async with make_client(config, n_replies(processor)) as client:
        r = await client.post(CHAT, json=chat_body(echo=True))  # the last message is the user's: nothing to echo
        assert r.json()["choices"][0]["message"]["content"] == REPLY
        body = chat_body(echo=True, add_generation_prompt=False, continue_final_message=True, n=2) | {
            "messages": ASSISTANT_LAST}
        r = await client.post(CHAT, json=body)
        assert r.status_code == 200, r.text
        assert [c["message"]["content"] for c in r.json()["choices"]] == ["The answer is" + REPLY] * 2
        r = await client.post(CHAT, json=body | {"stream": True})
        chunks = [c for c in parse_sse(r.text) if c != "[DONE]"]
        for index in (0, 1):
            deltas = [c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"][0]["index"] == index]
            assert deltas[:2] == ["", "The answer is"] and "".join(deltas) == "The answer is" + REPLY


@pytest.mark.parametrize("content", ["The answer is", [{"type": "text", "text": "The answer is"}]],
                         ids=["string", "parts"])
async def test_continue_final_message_matches_transformers(client, backend, qwen2_vl_dir, content) -> None:
    messages = [ASSISTANT_LAST[0], {"role": "assistant", "content": content}]
    hf = hf_processor(str(qwen2_vl_dir))
    expected = hf.tokenizer.encode(hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                                          continue_final_message=True))
    r = await client.post(CHAT, json=chat_body(add_generation_prompt=False, continue_final_message=True)
                          | {"messages": messages})
    assert r.status_code == 200, r.text
    assert backend.requests[-1].prompt_token_ids == expected
    assert hf.tokenizer.decode(expected).endswith("assistant\nThe answer is")
    r = await client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False,
                                             "continue_final_message": True})
    assert r.json()["tokens"] == expected
    # /tokenize refuses what chat refuses, with the same words.
    for body, why in (({"messages": messages, "continue_final_message": True}, "add_generation_prompt set to false"),
                      ({"messages": messages[:1], "add_generation_prompt": False, "continue_final_message": True},
                       "an assistant message last")):
        r = await client.post("/tokenize", json=body)
        assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "continue_final_message"
    # add_generation_prompt=False alone: the template's own rendering, its end-of-turn kept.
    await client.post(CHAT, json=chat_body(add_generation_prompt=False) | {"messages": messages})
    assert backend.requests[-1].prompt_token_ids == hf.tokenizer.encode(
        hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=False))
