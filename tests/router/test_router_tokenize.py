"""vLLM's /tokenize, /detokenize and /version: shapes, exact counts (a chat with an image
tokenizes to exactly the prompt the completion runs), errors, and API-key protection."""

from __future__ import annotations

from hf_reference import hf_prompt_ids, make_test_image
from routerkit import image_part, solid_png

from triptych.version import __version__


async def test_tokenize_prompt_and_detokenize(client, processor) -> None:
    r = await client.post("/tokenize", json={"model": "tiny-qwen", "prompt": "Hello there", "return_token_strs": True})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == processor.encode("Hello there") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 512 and len(body["token_strs"]) == body["count"]
    r = await client.post("/detokenize", json={"model": "tiny-qwen", "tokens": body["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": "Hello there"}


async def test_tokenize_chat_with_an_image_matches_the_completion_prompt(client, backend, qwen2_vl_dir) -> None:
    image = make_test_image(3, 56, 84)
    messages = [{"role": "user", "content": [image_part(solid_png(56, 84)), {"type": "text", "text": "What?"}]}]
    r = await client.post("/tokenize", json={"model": "tiny-qwen", "messages": messages})
    assert r.status_code == 200
    await client.post("/v1/chat/completions", json={"model": "tiny-qwen", "messages": messages, "max_tokens": 2})
    assert r.json()["tokens"] == backend.requests[-1].prompt_token_ids
    hf = hf_prompt_ids(qwen2_vl_dir, [{"role": "user", "content": [{"type": "image"},
                                                                    {"type": "text", "text": "What?"}]}], [image])
    assert r.json()["count"] == len(hf)


async def test_tokenize_errors_and_version(client) -> None:
    r = await client.post("/tokenize", json={"model": "tiny-qwen"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = await client.post("/tokenize", json={"model": "other", "prompt": "x"})
    assert r.status_code == 404
    r = await client.post("/detokenize", json={"model": "tiny-qwen", "tokens": [-1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert (await client.get("/version")).json() == {"version": __version__}


async def test_tokenize_needs_the_api_key(config, make_client, backend) -> None:
    async with make_client(config.model_copy(update={"api_keys": ["k"]}), backend) as client:
        assert (await client.post("/tokenize", json={"prompt": "x"})).status_code == 401
        ok = await client.post("/tokenize", json={"prompt": "x"}, headers={"Authorization": "Bearer k"})
        assert ok.status_code == 200
