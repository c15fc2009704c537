"""Client input -> a prompt the backend can run: chat messages to template messages with
their images (counts, lengths and pixel budgets checked up front), images resolved and
sized from their headers, the chat template and tokenization, placeholder checks, and the
context-length fit of max_tokens."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from triptych.processor import ImageInput, ImageTooLargeError, ProcessorError
from triptych.router.config import RouterConfig
from triptych.router.errors import InvalidRequestError
from triptych.router.images import FetchBudget, ImageRef
from triptych.router.protocol import ChatMessage, ImagePart, TextPart, VideoPart
from triptych.router.state import RouterState
from triptych.sampling_params import SamplingParams


@dataclass
class Prompt:
    """A validated, tokenized request ready for the backend."""

    token_ids: list[int]
    mm_items: list[Any] = field(default_factory=list)
    images: list[bytes] = field(default_factory=list)


def fit_context(state: RouterState, prompt_len: int, sampling: SamplingParams,
                 requested: int | None) -> SamplingParams:
    limit = state.max_model_len
    room = limit - prompt_len
    if room < 1:
        raise InvalidRequestError(
            f"This model's maximum context length is {limit} tokens, but the prompt is {prompt_len} "
            "tokens, which leaves no room for output. Shorten the messages or send fewer images.",
            param="messages", code="context_length_exceeded")
    if requested is not None and requested > room:
        raise InvalidRequestError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the "
            "completion). Reduce the prompt or max_tokens.", param="max_tokens", code="context_length_exceeded")
    return sampling.model_copy(update={"max_tokens": requested if requested is not None else room})


def _check_sizes(messages: list[ChatMessage], config: RouterConfig) -> None:
    """Counts and lengths before any work: a request's cost must be bounded up front."""
    if len(messages) > config.max_messages:
        raise InvalidRequestError(f"too many messages: {len(messages)} (at most {config.max_messages})",
                                  param="messages", code="too_many_messages")
    parts = sum(len(m.content) for m in messages if isinstance(m.content, list))
    if parts > config.max_content_parts:
        raise InvalidRequestError(f"too many content parts: {parts} (at most {config.max_content_parts})",
                                  param="messages", code="too_many_content_parts")
    chars = sum(len(m.content) if isinstance(m.content, str)
                else sum(len(p.text) for p in m.content if isinstance(p, TextPart))
                for m in messages if m.content is not None)
    if chars > config.max_prompt_chars:
        raise InvalidRequestError(f"the messages hold {chars} characters of text (at most "
                                  f"{config.max_prompt_chars})", param="messages", code="prompt_too_long")


def template_messages(messages: list[ChatMessage], config: RouterConfig,
                       ) -> tuple[list[dict[str, Any]], list[ImageRef]]:
    """OpenAI messages -> Hugging Face chat-template messages. Image parts become the
    template's own `{"type": "image"}` entries, in order (as vLLM does)."""
    _check_sizes(messages, config)
    out: list[dict[str, Any]] = []
    refs: list[ImageRef] = []
    for i, msg in enumerate(messages):
        role = "system" if msg.role == "developer" else msg.role
        if msg.content is None:
            raise InvalidRequestError(f"messages[{i}].content is required", param=f"messages[{i}].content")
        if isinstance(msg.content, str):
            out.append({"role": role, "content": msg.content})
            continue
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(msg.content):
            where = f"messages[{i}].content[{j}]"
            if isinstance(part, TextPart):
                parts.append({"type": "text", "text": part.text})
            elif isinstance(part, ImagePart):
                parts.append({"type": "image"})
                refs.append(ImageRef(part.image_url.url, f"{where}.image_url"))
            elif isinstance(part, VideoPart):
                raise InvalidRequestError("video_url content parts are not supported yet; send video "
                                          "frames as image_url parts", param=where, code="unsupported_content")
        out.append({"role": role, "content": parts})
    return out, refs


async def prepare_chat(state: RouterState, messages: list[dict[str, Any]], refs: list[ImageRef],
                       add_generation_prompt: bool = True) -> Prompt:
    limit = state.config.max_images_per_request
    if len(refs) > limit:
        raise InvalidRequestError(f"too many images: {len(refs)} (this server accepts at most {limit} "
                                  "per request)", param="messages", code="too_many_images")
    budget = FetchBudget(state.config.max_fetch_bytes_per_request)
    blobs = list(await asyncio.gather(*(state.images.load(ref, budget) for ref in refs)))
    processed = await asyncio.to_thread(_process, state, messages, refs, blobs, add_generation_prompt)
    prompt = Prompt(token_ids=list(processed.token_ids), mm_items=list(processed.mm_items), images=blobs)
    _check_placeholders(state, prompt)
    return prompt


def _process(state: RouterState, messages: list[dict[str, Any]], refs: list[ImageRef],
             blobs: list[bytes], add_generation_prompt: bool = True) -> Any:
    """Read each image's size from its header (no pixel is decoded here: the encode instance
    decodes, once) and apply the template. Runs in a worker thread (hashing and
    tokenization are CPU work that must not stall the event loop)."""
    images = []
    budget = state.config.max_request_pixels
    for ref, blob in zip(refs, blobs, strict=True):
        try:
            # The MM cache key is the hash of the bytes the client sent.
            image = ImageInput.probe(blob, state.config.max_image_pixels)
        except ImageTooLargeError as exc:
            raise InvalidRequestError(str(exc), param=ref.param, code="image_too_large") from None
        except ProcessorError as exc:
            raise InvalidRequestError(str(exc), param=ref.param, code="invalid_image") from None
        budget -= image.width * image.height
        if budget < 0:
            raise InvalidRequestError(f"the request's images hold more than {state.config.max_request_pixels} "
                                      "pixels in all; send fewer or smaller images", param=ref.param,
                                      code="image_too_large")
        images.append(image)
    try:
        return state.processor.process(messages, images, add_generation_prompt=add_generation_prompt)
    except ProcessorError as exc:  # the processor's contract: these are bad input
        raise InvalidRequestError(str(exc), param="messages") from None


def _check_placeholders(state: RouterState, prompt: Prompt) -> None:
    """Text that spells the model's image placeholder token would shift every image's
    embedding position: refuse it rather than serve a garbled answer."""
    if not state.placeholder_ids:
        return
    covered = sum(int(getattr(item, "length", 0)) for item in prompt.mm_items)
    found = sum(1 for t in prompt.token_ids if t in state.placeholder_ids)
    if found != covered:
        raise InvalidRequestError("the prompt text contains the model's image/video placeholder token; "
                                  "remove it and send images as image_url parts", param="messages")


def completion_prompt(state: RouterState, prompt: str | list[str] | list[int] | list[list[int]]) -> list[int]:
    if isinstance(prompt, list) and len(prompt) != 1 and (not prompt or not isinstance(prompt[0], int)):
        raise InvalidRequestError("send exactly one prompt per request (batched prompts are not supported)",
                                  param="prompt")
    if isinstance(prompt, list) and not isinstance(prompt[0], int):
        prompt = prompt[0]  # type: ignore[assignment]
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if len(prompt) > state.config.max_prompt_chars:
            raise InvalidRequestError(f"the prompt holds {len(prompt)} characters (at most "
                                      f"{state.config.max_prompt_chars})", param="prompt", code="prompt_too_long")
        ids = list(state.processor.encode(prompt))
    else:
        ids = list(prompt)  # type: ignore[arg-type]
        vocab = state.processor.vocab_size
        if not ids:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})",
                                      param="prompt")
    if any(t in state.placeholder_ids for t in ids):
        raise InvalidRequestError("the prompt contains the model's image/video placeholder token; "
                                  "images need /v1/chat/completions", param="prompt")
    return ids
