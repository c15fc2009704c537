"""The OpenAI-compatible HTTP API: `create_app(config, backend) -> FastAPI`.

A request's path through this module: the front door (auth, body size, metrics) ->
validation (pydantic; any failure is a 400 in OpenAI's error JSON) -> model name and
unsupported-field checks -> images loaded and decoded (limits checked before decoding)
-> chat template + tokenization (the processor) -> context-length check ->
`backend.generate` -> tokens detokenized, stop strings trimmed -> JSON or SSE.

Torch is never imported here: the router process holds no model weights.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from triptych.processor import ImageInput, ImageTooLargeError, MultimodalProcessor, ProcessorError
from triptych.router.backend import Backend, GenerationRequest
from triptych.router.config import RouterConfig, read_placeholder_ids
from triptych.router.errors import InvalidRequestError, OpenAIError, install_error_handlers
from triptych.router.images import ImageLoader, ImageRef
from triptych.router.metrics import FrontendMetrics
from triptych.router.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ImagePart,
    ModelCard,
    ModelList,
    TextPart,
    VideoPart,
)
from triptych.router.streaming import (
    CLIENT_GONE,
    STATUS_KEY,
    Detokenizer,
    EventPump,
    Job,
    OutputText,
    collect,
    sse_body,
)
from triptych.sampling_params import SamplingParams
from triptych.version import __version__

log = logging.getLogger("triptych.router.api")

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 500, 503, 504)
}


class _ClientGone(Exception):
    """The client disconnected before the response was complete."""


@dataclass
class Prompt:
    """A validated, tokenized request ready for the backend."""

    token_ids: list[int]
    mm_items: list[Any] = field(default_factory=list)
    images: list[bytes] = field(default_factory=list)


@dataclass
class RouterState:
    config: RouterConfig
    backend: Backend
    processor: MultimodalProcessor
    metrics: FrontendMetrics
    images: ImageLoader
    api_keys: frozenset[str]
    max_model_len: int
    placeholder_ids: frozenset[int]
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_name(self) -> str:
        return self.config.model_name

    def detokenizer(self, skip_special_tokens: bool) -> Detokenizer:
        return self.processor.detokenizer(skip_special_tokens=skip_special_tokens)


def create_app(config: RouterConfig, backend: Backend, *, processor: MultimodalProcessor | None = None,
               registry: CollectorRegistry | None = None) -> FastAPI:
    """The router's FastAPI app. `processor` defaults to the checkpoint's
    MultimodalProcessor; `registry` lets the caller add its own collectors to /metrics."""
    if processor is None:
        processor = MultimodalProcessor.from_pretrained(config.model, max_image_pixels=config.max_image_pixels)
    state = RouterState(
        config=config, backend=backend, processor=processor,
        metrics=FrontendMetrics(config.model_name, config.ttft_slo_s, config.tbt_slo_s,
                                window=config.slo_window, registry=registry),
        images=ImageLoader(config), api_keys=config.load_api_keys(),
        max_model_len=config.resolved_max_model_len(), placeholder_ids=read_placeholder_ids(config.model),
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await state.images.aclose()

    app = FastAPI(title="Triptych router", version=__version__, lifespan=lifespan)
    app.state.triptych = state
    install_error_handlers(app)
    app.add_middleware(FrontDoor, state=state)
    _add_generation_routes(app, state)
    _add_service_routes(app, state)
    return app


# --- front door: auth, body size, in-flight gauge, status counter -----------------------


class FrontDoor:
    """Pure ASGI middleware for /v1/*: checks the API key before the body is even read
    (so an unauthenticated client learns nothing about validation), reads the body under
    the size cap, turns an unexpected exception into a logged 500 in OpenAI's shape, and
    records every generation request's final status once its response has ended."""

    def __init__(self, app: ASGIApp, state: RouterState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        counted = scope["method"] == "POST" and scope["path"] in GENERATION_PATHS
        metrics = self.state.metrics
        started: dict[str, int] = {}

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                started["status"] = message["status"]
            await send(message)

        if counted:
            metrics.in_flight.labels(metrics.model).inc()
        try:
            self._authorize(scope)
            replay = await _read_body(scope, receive, self.state.config.max_request_bytes)
            await self.app(scope, replay, send_wrapper)
        except OpenAIError as exc:
            await _send_error(exc, scope, receive, send_wrapper, started)
        except _ClientGone:
            scope[STATUS_KEY] = CLIENT_GONE
        except asyncio.CancelledError:
            scope.setdefault(STATUS_KEY, CLIENT_GONE)
            raise
        except Exception:
            log.exception("unhandled error serving %s", scope["path"])
            err = OpenAIError(500, "internal server error", code="internal_error")
            await _send_error(err, scope, receive, send_wrapper, started)
        finally:
            if counted:
                metrics.in_flight.labels(metrics.model).dec()
                metrics.request_done(scope.get(STATUS_KEY) or started.get("status", 500))

    def _authorize(self, scope: Scope) -> None:
        if not self.state.api_keys:
            return
        auth = next((v.decode("latin-1") for k, v in scope["headers"] if k.lower() == b"authorization"), "")
        scheme, _, token = auth.partition(" ")
        if not auth:
            raise OpenAIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        if scheme.lower() != "bearer" or not _key_matches(token.strip(), self.state.api_keys):
            raise OpenAIError(401, "invalid API key", code="invalid_api_key")


async def _send_error(err: OpenAIError, scope: Scope, receive: Receive, send: Send,
                      started: dict[str, int]) -> None:
    if "status" in started:  # too late for a status: the response is under way
        return
    await err.response()(scope, receive, send)


def _key_matches(token: str, keys: frozenset[str]) -> bool:
    # Compare against every key in constant time: timing must not reveal a key's prefix.
    found = False
    for key in keys:
        found |= hmac.compare_digest(token.encode(), key.encode())
    return found


async def _read_body(scope: Scope, receive: Receive, limit: int) -> Receive:
    """Read the whole body under `limit` (413 past it, Content-Length or not), then hand
    the app a receive that replays it and afterwards reports the client's disconnect."""
    too_large = OpenAIError(413, f"request body is larger than the {limit} byte limit", code="request_too_large")
    declared = next((v for k, v in scope["headers"] if k.lower() == b"content-length"), b"")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks: list[bytes] = []
    total = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone()
        total += len(message.get("body", b""))
        if total > limit:
            raise too_large
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    pending: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay


# --- generation endpoints -----------------------------------------------------------------


def _add_generation_routes(app: FastAPI, state: RouterState) -> None:
    @app.post("/v1/chat/completions", responses={200: {"model": ChatCompletionResponse}, **ERROR_RESPONSES})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        _check_request(state, body)
        sampling = _sampling(body, body.requested_max_tokens)
        started = time.monotonic()
        messages, refs = _template_messages(body.messages)
        prompt = await _prepare_chat(state, messages, refs)
        state.metrics.preprocess.labels(state.model_name).observe(time.monotonic() - started)
        sampling = _fit_context(state, len(prompt.token_ids), sampling, body.requested_max_tokens)
        return await _generate(state, request, body, prompt, sampling, chat=True)

    @app.post("/v1/completions", responses={200: {"model": CompletionResponse}, **ERROR_RESPONSES})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_request(state, body)
        sampling = _sampling(body, body.max_tokens)
        prompt = Prompt(token_ids=await asyncio.to_thread(_completion_prompt, state, body.prompt))
        sampling = _fit_context(state, len(prompt.token_ids), sampling, body.max_tokens)
        return await _generate(state, request, body, prompt, sampling, chat=False)


def _check_request(state: RouterState, body: ChatCompletionRequest | CompletionRequest) -> None:
    if body.model != state.model_name:
        raise OpenAIError(404, f"The model `{body.model}` does not exist (this server serves "
                               f"`{state.model_name}`).", param="model", code="model_not_found")
    unsupported = body.unsupported_fields()
    if unsupported:
        name, why = unsupported[0]
        raise InvalidRequestError(f"{name}: {why}", param=name, code="unsupported_parameter")


def _sampling(body: ChatCompletionRequest | CompletionRequest, max_tokens: int | None) -> SamplingParams:
    """Range-checked sampling parameters; max_tokens is fixed up by `_fit_context`."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    values: dict[str, Any] = {
        "top_k": 0 if body.top_k in (None, -1) else body.top_k,
        "seed": body.seed, "stop": stop, "stop_token_ids": body.stop_token_ids or [],
        "ignore_eos": body.ignore_eos, "max_tokens": 1 if max_tokens is None else max_tokens,
    }
    if body.temperature is not None:
        values["temperature"] = body.temperature
    if body.top_p is not None:
        values["top_p"] = body.top_p
    try:
        return SamplingParams(**values)
    except ValidationError as exc:
        err = exc.errors()[0]
        name = str(err["loc"][0]) if err["loc"] else None
        if name == "max_tokens" and isinstance(body, ChatCompletionRequest) \
                and body.max_completion_tokens is not None:
            name = "max_completion_tokens"
        raise InvalidRequestError(f"{name}: {err['msg']}", param=name) from None


def _fit_context(state: RouterState, prompt_len: int, sampling: SamplingParams,
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


# --- chat messages -> template messages + images ------------------------------------------


def _template_messages(messages: list[ChatMessage]) -> tuple[list[dict[str, Any]], list[ImageRef]]:
    """OpenAI messages -> Hugging Face chat-template messages. Image parts become the
    template's own `{"type": "image"}` entries, in order (as vLLM does)."""
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


async def _prepare_chat(state: RouterState, messages: list[dict[str, Any]], refs: list[ImageRef]) -> Prompt:
    limit = state.config.max_images_per_request
    if len(refs) > limit:
        raise InvalidRequestError(f"too many images: {len(refs)} (this server accepts at most {limit} "
                                  "per request)", param="messages", code="too_many_images")
    blobs = list(await asyncio.gather(*(state.images.load(ref) for ref in refs)))
    processed = await asyncio.to_thread(_process, state, messages, refs, blobs)
    prompt = Prompt(token_ids=list(processed.token_ids), mm_items=list(processed.mm_items), images=blobs)
    _check_placeholders(state, prompt)
    return prompt


def _process(state: RouterState, messages: list[dict[str, Any]], refs: list[ImageRef],
             blobs: list[bytes]) -> Any:
    """Decode the images (pixel limit checked before decoding) and apply the template.
    Runs in a worker thread: both are CPU work that must not stall the event loop."""
    images = []
    for ref, blob in zip(refs, blobs, strict=True):
        try:
            # The MM cache key is the hash of the bytes the client sent.
            images.append(ImageInput.from_bytes(blob, state.config.max_image_pixels))
        except ImageTooLargeError as exc:
            raise InvalidRequestError(str(exc), param=ref.param, code="image_too_large") from None
        except ProcessorError as exc:
            raise InvalidRequestError(str(exc), param=ref.param, code="invalid_image") from None
    try:
        return state.processor.process(messages, images)
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


def _completion_prompt(state: RouterState, prompt: str | list[str] | list[int] | list[list[int]]) -> list[int]:
    if isinstance(prompt, list) and len(prompt) != 1 and (not prompt or not isinstance(prompt[0], int)):
        raise InvalidRequestError("send exactly one prompt per request (batched prompts are not supported)",
                                  param="prompt")
    if isinstance(prompt, list) and not isinstance(prompt[0], int):
        prompt = prompt[0]  # type: ignore[assignment]
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
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


# --- running a request -------------------------------------------------------------------


async def _generate(state: RouterState, request: Request, body: ChatCompletionRequest | CompletionRequest,
                    prompt: Prompt, sampling: SamplingParams, chat: bool) -> Response:
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    job = Job(request_id=request_id, model=state.model_name, chat=chat, prompt_len=len(prompt.token_ids),
              max_tokens=sampling.max_tokens, metrics=state.metrics,
              output=OutputText(state.detokenizer(body.skip_special_tokens), sampling.stop),
              return_token_ids=body.return_token_ids)
    gen = GenerationRequest(request_id=request_id, prompt_token_ids=prompt.token_ids,
                            mm_items=prompt.mm_items, images=prompt.images, sampling=sampling,
                            model=state.model_name)
    metrics = state.metrics
    metrics.prompt_tokens.labels(state.model_name).inc(len(prompt.token_ids))
    metrics.images.labels(state.model_name).inc(len(prompt.images))
    pump = EventPump(state.backend.generate(gen), state.config.abort_timeout_s)
    headers = {"X-Request-Id": request_id}
    try:
        if not body.stream:
            result = await _until_disconnect(request, collect(job, pump))
            return JSONResponse(result, headers=headers)
        # Wait for the first event before sending headers: a failure before the first
        # token (no instance, overload) is then a real HTTP status with Retry-After.
        await _until_disconnect(request, pump.prime())
    except BaseException as exc:
        await pump.close()
        if isinstance(exc, _ClientGone):
            request.scope[STATUS_KEY] = CLIENT_GONE
            return Response(status_code=CLIENT_GONE)
        raise
    options = body.stream_options
    include_usage = bool(options and options.include_usage)
    continuous = bool(options and options.continuous_usage_stats)
    return StreamingResponse(sse_body(job, pump, request.scope, include_usage, continuous),
                             media_type="text/event-stream",
                             headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Await `work` unless the client disconnects first (then cancel it, raise _ClientGone)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    if task.cancelled():
        raise _ClientGone()
    return task.result()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# --- models, health, metrics ---------------------------------------------------------------


def _add_service_routes(app: FastAPI, state: RouterState) -> None:
    def card() -> ModelCard:
        return ModelCard(id=state.model_name, created=state.created, root=str(state.config.model),
                         max_model_len=state.max_model_len)

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        return ModelList(data=[card()])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=ERROR_RESPONSES)
    async def get_model(model_id: str) -> ModelCard:
        if model_id != state.model_name:
            raise OpenAIError(404, f"The model `{model_id}` does not exist.", param="model",
                              code="model_not_found")
        return card()

    @app.get("/health")
    async def health() -> JSONResponse:
        try:
            report = await asyncio.wait_for(state.backend.health(), state.config.health_timeout_s)
            if not isinstance(report, dict):
                raise TypeError(f"backend.health() returned {type(report).__name__}, not a dict")
        except Exception as exc:  # a health probe must answer, whatever the backend does
            report = {"status": "unavailable", "error": f"{type(exc).__name__}: {exc}"}
        return JSONResponse(report, status_code=200 if report.get("status") == "ok" else 503)

    @app.get("/live")
    async def live() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ok = bool(state.backend.ready())
        return JSONResponse({"status": "ready" if ok else "not ready"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
