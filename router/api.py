"""The OpenAI-compatible HTTP API: `create_app(config, backend) -> FastAPI`.

A request's path: the front door (front_door.py: auth, body size and deadline, metrics) ->
validation (pydantic; any failure is a 400 in OpenAI's error JSON) -> model name and
unsupported-field checks -> the prompt (prompt.py: caps, images sized from their headers,
chat template + tokenization, context-length fit) -> `backend.generate` -> tokens
detokenized, stop strings trimmed (streaming.py) -> JSON or SSE.

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
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import ValidationError

from triptych.processor import MultimodalProcessor
from triptych.router import tokenize
from triptych.router.backend import Backend, GenerationRequest
from triptych.router.config import RouterConfig, read_placeholder_ids
from triptych.router.errors import InvalidRequestError, OpenAIError, install_error_handlers
from triptych.router.front_door import PUMP_KEY, ClientGone, FrontDoor
from triptych.router.images import ImageLoader
from triptych.router.metrics import FrontendMetrics, RequestTimer
from triptych.router.prompt import (
    Prompt,
    completion_prompt,
    fit_context,
    prepare_chat,
    template_messages,
    truncate_prompt,
)
from triptych.router.protocol import ChatCompletionRequest, CompletionRequest
from triptych.router.responses import (
    ChatCompletionResponse,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from triptych.router.state import RouterState
from triptych.router.streaming import (
    CLIENT_GONE,
    STATUS_KEY,
    Choice,
    EventPump,
    Job,
    OutputText,
    collect,
    sse_body,
)
from triptych.router.structured import request_grammar
from triptych.router.tools import check_tools, render_messages, tool_choice_grammar
from triptych.sampling_params import SamplingParams
from triptych.version import __version__

log = logging.getLogger("triptych.router.api")

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 408, 413, 429, 500, 503, 504)
}


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
        admin_token=config.load_admin_token(),
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
    tokenize.add_routes(app, state)
    return app


# --- generation endpoints -----------------------------------------------------------------


def _add_generation_routes(app: FastAPI, state: RouterState) -> None:
    @app.post("/v1/chat/completions", responses={200: {"model": ChatCompletionResponse}, **ERROR_RESPONSES})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        _check_request(state, body)
        sampling = _sampling(body, body.requested_max_tokens)
        started = time.monotonic()
        check_tools(body.tools, body.tool_choice)
        # Compiled before any work: a schema that does not compile is a 400 (structured.py).
        grammar = request_grammar(body, tool_choice_grammar(body.tools, body.tool_choice))
        messages, refs = template_messages(render_messages(body.messages, body.tools), state.config)
        prompt = await prepare_chat(state, messages, refs, body.add_generation_prompt,
                                    mm_processor_kwargs=body.mm_processor_kwargs,
                                    template_kwargs=body.chat_template_kwargs,
                                    continue_final_message=body.continue_final_message)
        prompt = truncate_prompt(prompt, body.truncate_prompt_tokens)
        state.metrics.preprocess.labels(state.model_name).observe(time.monotonic() - started)
        sampling = fit_context(state, len(prompt.token_ids), sampling, body.requested_max_tokens)
        parse_tools = bool(body.tools) and body.tool_choice != "none"
        return await _generate(state, request, body, prompt, sampling, chat=True, grammar=grammar,
                               parse_tools=parse_tools, echo=body.echo_text)

    @app.post("/v1/completions", responses={200: {"model": CompletionResponse}, **ERROR_RESPONSES})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_request(state, body)
        sampling = _sampling(body, body.max_tokens)
        grammar = request_grammar(body)
        prompt = Prompt(token_ids=await asyncio.to_thread(completion_prompt, state, body.prompt))
        prompt = truncate_prompt(prompt, body.truncate_prompt_tokens)
        sampling = fit_context(state, len(prompt.token_ids), sampling, body.max_tokens)
        echo = await asyncio.to_thread(_echo_text, state, body, prompt) if body.echo else ""
        return await _generate(state, request, body, prompt, sampling, chat=False, grammar=grammar, echo=echo)


def _echo_text(state: RouterState, body: CompletionRequest, prompt: Prompt) -> str:
    """The prompt as `echo` returns it: the client's text, or (token ids, or a prompt cut by
    truncate_prompt_tokens) the prompt's tokens detokenized."""
    text = body.prompt if isinstance(body.prompt, str) else None
    if isinstance(body.prompt, list) and len(body.prompt) == 1 and isinstance(body.prompt[0], str):
        text = body.prompt[0]
    if text is None or body.truncate_prompt_tokens is not None:
        text = state.processor.decode(prompt.token_ids, False)
    return text


def _check_request(state: RouterState, body: ChatCompletionRequest | CompletionRequest) -> None:
    if body.model != state.model_name:
        raise OpenAIError(404, f"The model `{body.model}` does not exist (this server serves "
                               f"`{state.model_name}`).", param="model", code="model_not_found")
    unsupported = body.unsupported_fields()
    if unsupported:
        name, why = unsupported[0]
        raise InvalidRequestError(f"{name}: {why}", param=name, code="unsupported_parameter")
    # Token ids the sampler would index with: refused here, with the field named, rather
    # than by the worker after routing.
    vocab = state.processor.vocab_size
    for name, ids in (("logit_bias", [int(k) for k in body.logit_bias or {}]),
                      ("stop_token_ids", body.stop_token_ids or [])):
        bad = next((t for t in ids if t >= vocab), None)  # negative ids: SamplingParams says so
        if bad is not None:
            raise InvalidRequestError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab})", param=name)


def _sampling(body: ChatCompletionRequest | CompletionRequest, max_tokens: int | None) -> SamplingParams:
    """Range-checked sampling parameters; max_tokens is fixed up by `_fit_context`."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    values: dict[str, Any] = {
        "top_k": 0 if body.top_k in (None, -1) else body.top_k,
        "seed": body.seed, "stop": stop, "stop_token_ids": body.stop_token_ids or [],
        "ignore_eos": body.ignore_eos, "max_tokens": max(1, body.min_tokens) if max_tokens is None else max_tokens,
        "presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
        "repetition_penalty": body.repetition_penalty, "min_tokens": body.min_tokens,
        "logit_bias": {int(k): v for k, v in (body.logit_bias or {}).items()},
        "n": body.num_sequences,
    }
    if isinstance(body, ChatCompletionRequest):
        values["logprobs"] = body.logprobs
        values["top_logprobs"] = body.top_logprobs or 0
    else:
        values["logprobs"] = body.logprobs is not None
        values["top_logprobs"] = body.logprobs or 0
    if body.num_sequences > body.n:  # best_of ranks the sequences by their log-probs
        values["logprobs"] = True
    for name in ("temperature", "top_p", "min_p"):
        if getattr(body, name) is not None:
            values[name] = getattr(body, name)
    try:
        return SamplingParams(**values)
    except ValidationError as exc:
        err = exc.errors()[0]
        name = str(err["loc"][0]) if err["loc"] else None
        if name is None and "min_tokens" in err["msg"]:
            name = "min_tokens"
        if name == "max_tokens" and isinstance(body, ChatCompletionRequest) \
                and body.max_completion_tokens is not None:
            name = "max_completion_tokens"
        raise InvalidRequestError(f"{name}: {err['msg']}", param=name) from None


# --- running a request -------------------------------------------------------------------


async def _generate(state: RouterState, request: Request, body: ChatCompletionRequest | CompletionRequest,
                    prompt: Prompt, sampling: SamplingParams, chat: bool, grammar: str | None = None,
                    parse_tools: bool = False, echo: str = "") -> Response:
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    choices = [Choice(OutputText(state.detokenizer(body.skip_special_tokens), sampling.stop, sampling.min_tokens,
                                 include_stop=body.include_stop_str_in_output))
               for _ in range(sampling.n)]
    asked_logprobs = body.logprobs is not None and body.logprobs is not False
    token_text = _token_id_text if body.return_tokens_as_token_ids else state.token_text
    job = Job(request_id=request_id, model=state.model_name, chat=chat, prompt_len=len(prompt.token_ids),
              max_tokens=sampling.max_tokens, metrics=state.metrics, choices=choices,
              return_token_ids=body.return_token_ids, logprobs=asked_logprobs,
              token_text=token_text, keep=body.n, parse_tools=parse_tools, echo=echo,
              timer=RequestTimer(spread=not body.stream))
    gen = GenerationRequest(request_id=request_id, prompt_token_ids=prompt.token_ids,
                            mm_items=prompt.mm_items, images=prompt.images, sampling=sampling,
                            model=state.model_name, grammar=grammar, stream=bool(body.stream))
    metrics = state.metrics
    metrics.prompt_tokens.labels(state.model_name).inc(len(prompt.token_ids))
    metrics.images.labels(state.model_name).inc(len(prompt.images))
    pump = EventPump(state.backend.generate(gen), state.config.abort_timeout_s)
    request.scope[PUMP_KEY] = pump
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
        if isinstance(exc, ClientGone):
            request.scope[STATUS_KEY] = CLIENT_GONE
            return Response(status_code=CLIENT_GONE)
        raise
    options = body.stream_options
    include_usage = bool(options and options.include_usage)
    continuous = bool(options and options.continuous_usage_stats)
    return StreamingResponse(sse_body(job, pump, request.scope, include_usage, continuous),
                             media_type="text/event-stream",
                             headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _token_id_text(token_id: int) -> str:
    """vLLM's return_tokens_as_token_ids spelling: exact even for tokens that are not whole UTF-8."""
    return f"token_id:{token_id}"


async def _until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Await `work` unless the client disconnects first (then cancel it, raise ClientGone)."""
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
        raise ClientGone()
    return task.result()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# --- models, health, metrics ---------------------------------------------------------------

PUBLIC_HEALTH_KEYS = ("status", "roles", "stages")


def _is_admin(request: Request, state: RouterState) -> bool:
    token = state.admin_token
    auth = request.headers.get("authorization", "")
    scheme, _, given = auth.partition(" ")
    return bool(token) and scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())



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
    async def health(request: Request) -> JSONResponse:
        try:
            report = await asyncio.wait_for(state.backend.health(), state.config.health_timeout_s)
            if not isinstance(report, dict):
                raise TypeError(f"backend.health() returned {type(report).__name__}, not a dict")
        except Exception as exc:  # a health probe must answer, whatever the backend does
            report = {"status": "unavailable", "error": f"{type(exc).__name__}: {exc}"}
        code = 200 if report.get("status") == "ok" else 503
        if not _is_admin(request, state):  # others learn the status, not where the workers are
            report = {k: v for k, v in report.items() if k in PUBLIC_HEALTH_KEYS}
        return JSONResponse(report, status_code=code)

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
