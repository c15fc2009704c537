"""Client input -> a prompt the backend can run: chat messages to template messages with
their images and videos (counts, lengths and pixel budgets checked up front), images
resolved and sized from their headers, videos demuxed and counted (router/videos.py), the
chat template and tokenization, placeholder checks, and the context-length fit of
max_tokens."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from typing import Any

from triptych.processor import ImageInput, ImageTooLargeError, MMItem, ProcessorError
from triptych.router.config import RouterConfig
from triptych.router.errors import InvalidRequestError
from triptych.router.images import FetchBudget, ImageRef
from triptych.router.protocol import ChatMessage, ImagePart, TextPart, VideoPart
from triptych.router.state import RouterState
from triptych.router.videos import check_keys, limits_of, probe_video, resolve_options, video_model
from triptych.sampling_params import SamplingParams
from triptych.stage_protocol import frame_content_key
from triptych.video_processing import VideoTokens, expand_videos


@dataclass
class Prompt:
    """A validated, tokenized request ready for the backend."""

    token_ids: list[int]
    mm_items: list[Any] = field(default_factory=list)
    images: list[bytes] = field(default_factory=list)  # encoded bytes, one per mm item (image or video)


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


def truncate_prompt(prompt: Prompt, keep: int | None) -> Prompt:
    """vLLM's `truncate_prompt_tokens`: keep the prompt's last `keep` tokens. A cut through
    an image or video would leave the encoder's output without its placeholders: a 400."""
    if keep is None or keep >= len(prompt.token_ids):
        return prompt
    cut = len(prompt.token_ids) - keep
    if any(item.offset < cut for item in prompt.mm_items):
        raise InvalidRequestError(f"truncate_prompt_tokens={keep} would cut an image or video out of the "
                                  "prompt", param="truncate_prompt_tokens")
    items = [replace(item, offset=item.offset - cut) for item in prompt.mm_items]
    return Prompt(token_ids=prompt.token_ids[cut:], mm_items=items, images=prompt.images)


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
    """OpenAI messages -> Hugging Face chat-template messages. Image and video parts become
    the template's own `{"type": "image"}` / `{"type": "video"}` entries, in order (as vLLM
    does); the refs keep their order and kind."""
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
                parts.append({"type": "video"})
                refs.append(ImageRef(part.video_url.url, f"{where}.video_url", kind="video"))
        out.append({"role": role, "content": parts})
    return out, refs


# Keys a client's chat_template_kwargs may not override (the router sets them).
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "add_generation_prompt", "continue_final_message", "tokenize",
                                      "conversation"})


async def prepare_chat(state: RouterState, messages: list[dict[str, Any]], refs: list[ImageRef],
                       add_generation_prompt: bool = True, mm_processor_kwargs: dict[str, Any] | None = None,
                       template_kwargs: dict[str, Any] | None = None, continue_final_message: bool = False
                       ) -> Prompt:
    image_refs = [r for r in refs if r.kind == "image"]
    video_refs = [r for r in refs if r.kind == "video"]
    limit = state.config.max_images_per_request
    if len(image_refs) > limit:
        raise InvalidRequestError(f"too many images: {len(image_refs)} (this server accepts at most {limit} "
                                  "per request)", param="messages", code="too_many_images")
    check_keys(mm_processor_kwargs, has_images=bool(image_refs))
    _check_videos(state, video_refs, mm_processor_kwargs)
    budget = FetchBudget(state.config.max_fetch_bytes_per_request)
    blobs = list(await asyncio.gather(*(state.images.load(ref, budget) for ref in refs)))
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(template_kwargs or {}))
    if reserved:
        raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(reserved)}",
                                  param="chat_template_kwargs")
    template = {**(template_kwargs or {}), "continue_final_message": continue_final_message}
    processed, by_hash = await asyncio.to_thread(_process, state, messages, refs, blobs, add_generation_prompt,
                                                 mm_processor_kwargs, template)
    items = list(processed.mm_items)
    prompt = Prompt(token_ids=list(processed.token_ids), mm_items=items,
                    images=[by_hash[m.content_hash] for m in items])
    _check_placeholders(state, prompt)
    return prompt


def _check_videos(state: RouterState, refs: list[ImageRef], kwargs: dict[str, Any] | None) -> None:
    if not refs:
        return
    limit = state.config.max_videos_per_request
    if len(refs) > limit:
        raise InvalidRequestError(f"too many videos: {len(refs)} (this server accepts at most {limit} "
                                  "per request)", param="messages", code="too_many_videos")
    model = video_model(str(state.config.model))
    if model is None:  # a checkpoint with neither a video token nor frames-as-images support
        raise InvalidRequestError(f"model {state.model_name} does not accept video input; send sampled "
                                  "frames as image_url parts", param=refs[0].param, code="unsupported_content")
    resolve_options(kwargs, model, state.config)  # bad options fail before any fetch


def _process(state: RouterState, messages: list[dict[str, Any]], refs: list[ImageRef],
             blobs: list[bytes], add_generation_prompt: bool = True,
             mm_processor_kwargs: dict[str, Any] | None = None,
             template_kwargs: dict[str, Any] | None = None) -> tuple[Any, dict[str, bytes]]:
    """Read each image's size from its header and each video's frames and timing from its
    container (no pixel is decoded here: the encode instance decodes, once), apply the
    template and expand the video runs. Runs in a worker thread (hashing, demuxing and
    tokenization are CPU work that must not stall the event loop). Also returns the bytes
    by content hash (a frame taken as an image maps to its video's bytes)."""
    by_hash: dict[str, bytes] = {}
    videos = _probe_videos(state, refs, blobs, mm_processor_kwargs, by_hash)
    model = video_model(str(state.config.model)) if videos else None
    frames: dict[str, tuple[VideoTokens, int]] = {}
    inputs: list[ImageInput] = []  # in placeholder order
    budget = state.config.max_request_pixels
    pending = iter(videos)
    for ref, blob in zip(refs, blobs, strict=True):
        if ref.kind == "image":
            image = _probe_image(state, ref, blob)
            budget -= image.width * image.height
            if budget < 0:
                raise InvalidRequestError(f"the request's images hold more than {state.config.max_request_pixels} "
                                          "pixels in all; send fewer or smaller images", param=ref.param,
                                          code="image_too_large")
            inputs.append(image)
            by_hash[image.content_hash] = blob
        elif model is not None and model.frames_as_images:
            inputs.extend(_frame_images(next(pending), blob, frames, by_hash))
    if frames:  # LLaVA: the template sees each video as its sampled frames, one image each
        messages = _videos_as_frames(messages, [v.grid_thw[0] for v in videos])
    try:
        processed = state.processor.process(messages, inputs, add_generation_prompt=add_generation_prompt,
                                            **(template_kwargs or {}))
        if frames:
            processed = replace(processed, mm_items=[_as_frame(m, frames) for m in processed.mm_items])
        elif videos:
            assert model is not None and model.video_token_id is not None
            processed = expand_videos(processed, model.video_token_id, model.config.merge_size, videos)
    except ProcessorError as exc:  # the processor's contract: these are bad input
        raise InvalidRequestError(str(exc), param="messages") from None
    return processed, by_hash


def _probe_videos(state: RouterState, refs: list[ImageRef], blobs: list[bytes],
                  kwargs: dict[str, Any] | None, by_hash: dict[str, bytes]) -> list[VideoTokens]:
    """Each video demuxed, sampled and counted (router/videos.py), in request order."""
    video_refs = [(ref, blob) for ref, blob in zip(refs, blobs, strict=True) if ref.kind == "video"]
    if not video_refs:
        return []
    model = video_model(str(state.config.model))
    assert model is not None  # _check_videos refused the request otherwise
    cfg, options, resolved = resolve_options(kwargs, model, state.config)
    limits = limits_of(state.config)
    videos = []
    for ref, blob in video_refs:
        videos.append(probe_video(blob, ref.param, model, cfg, options, resolved, limits))
        by_hash[videos[-1].content_hash] = blob
    return videos


def _probe_image(state: RouterState, ref: ImageRef, blob: bytes) -> ImageInput:
    try:
        # The MM cache key is the hash of the bytes the client sent.
        return ImageInput.probe(blob, state.config.max_image_pixels)
    except ImageTooLargeError as exc:
        raise InvalidRequestError(str(exc), param=ref.param, code="image_too_large") from None
    except ProcessorError as exc:
        raise InvalidRequestError(str(exc), param=ref.param, code="invalid_image") from None


def _frame_images(video: VideoTokens, blob: bytes, frames: dict[str, tuple[VideoTokens, int]],
                  by_hash: dict[str, bytes]) -> list[ImageInput]:
    """A video's sampled frames as images (no pixels: the encode instance decodes them),
    each keyed by `frame_content_key` (the video's key and the frame's position)."""
    out = []
    for index in range(video.grid_thw[0]):  # the frames-as-images grid is (n sampled frames, H, W)
        key = frame_content_key(video.content_hash, index)
        frames[key] = (video, index)
        by_hash[key] = blob
        out.append(ImageInput(None, key, video.width, video.height))
    return out


def _videos_as_frames(messages: list[dict[str, Any]], counts: list[int]) -> list[dict[str, Any]]:
    """Each `{"type": "video"}` part replaced, in place, by one `{"type": "image"}` per
    sampled frame: the chat template renders them as the images they are fed as."""
    pending = iter(counts)
    out = []
    for msg in messages:
        content = msg.get("content")
        if isinstance(content, list):
            parts: list[Any] = []
            for part in content:
                is_video = isinstance(part, dict) and part.get("type") == "video"
                parts.extend([{"type": "image"}] * next(pending) if is_video else [part])
            msg = {**msg, "content": parts}
        out.append(msg)
    return out


def _as_frame(item: MMItem, frames: dict[str, tuple[VideoTokens, int]]) -> MMItem:
    if item.content_hash not in frames:
        return item
    video, index = frames[item.content_hash]
    return replace(item, frame_of=video.content_hash, frame_index=index, frame_count=video.grid_thw[0],
                   video_options=video.options)


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
