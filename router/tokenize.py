"""vLLM's utility endpoints: `POST /tokenize`, `POST /detokenize` and `GET /version`, in
vLLM's request and response shapes, so tooling written against vLLM works unchanged.

`/tokenize` with `messages` goes through the same path as a chat completion (chat template,
images sized from their headers, placeholders expanded), so its count is exactly the prompt
length a completion would have."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI
from pydantic import Field

from triptych.router.errors import InvalidRequestError, OpenAIError
from triptych.router.prompt import completion_prompt, prepare_chat, template_messages
from triptych.router.protocol import ChatMessage, _Strict, continue_final_message_error
from triptych.router.state import RouterState
from triptych.version import __version__


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # for `prompt`
    add_generation_prompt: bool = True  # for `messages`
    continue_final_message: bool = False  # for `messages`: the prompt ends inside the last message (as chat)
    mm_processor_kwargs: dict[str, Any] | None = None  # for `messages` with videos (as chat)
    return_token_strs: bool = False


class TokenizeResponse(_Strict):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int] = Field(max_length=1_000_000)


class DetokenizeResponse(_Strict):
    prompt: str


def add_routes(app: FastAPI, state: RouterState) -> None:
    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        _check_model(state, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequestError("send exactly one of `prompt` and `messages`", param="prompt")
        if body.messages is not None:
            messages, refs = template_messages(body.messages, state.config)
            if why := continue_final_message_error(body.messages, body.continue_final_message,
                                                   body.add_generation_prompt):
                raise InvalidRequestError(why, param="continue_final_message")
            ids = (await prepare_chat(state, messages, refs, body.add_generation_prompt, body.mm_processor_kwargs,
                                      continue_final_message=body.continue_final_message)).token_ids
        else:
            ids = await asyncio.to_thread(_encode_prompt, state, body.prompt or "", body.add_special_tokens)
        strs = [state.processor.tokenizer.id_to_token(t) or "" for t in ids] if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids, token_strs=strs)

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        _check_model(state, body.model)
        vocab = state.processor.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
        text = await asyncio.to_thread(state.processor.decode, body.tokens, False)
        return DetokenizeResponse(prompt=text)

    @app.get("/version")
    async def version() -> dict[str, Any]:
        return {"version": __version__}


def _check_model(state: RouterState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise OpenAIError(404, f"The model `{model}` does not exist (this server serves `{state.model_name}`).",
                          param="model", code="model_not_found")


def _encode_prompt(state: RouterState, prompt: str, add_special_tokens: bool) -> list[int]:
    if add_special_tokens:
        return completion_prompt(state, prompt)
    if len(prompt) > state.config.max_prompt_chars:
        raise InvalidRequestError(f"the prompt holds {len(prompt)} characters (at most "
                                  f"{state.config.max_prompt_chars})", param="prompt", code="prompt_too_long")
    return state.processor.tokenizer.encode(prompt, add_special_tokens=False).ids
