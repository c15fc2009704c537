"""The response side of a request: token events in, OpenAI JSON or SSE out.

`EventPump` (event_pump.py) relays the backend's events (and its cancellation), `OutputText` turns token
ids into text with stop strings applied, `collect` builds a non-streaming response and
`sse_body` the `data: ...` stream that ends in `data: [DONE]`.

Detokenization itself is the processor's (`MultimodalProcessor.detokenizer`): a
multi-byte character split across tokens is held back until complete, so the client
never sees a broken UTF-8 fragment.

Stop strings: the backend is asked to stop on them too, but the router is what trims
them from the text, and it holds back any tail that could still grow into a stop string
(`triptych.stop_strings`, shared with the worker's engine).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from triptych.router import logprobs
from triptych.router.backend import BackendError
from triptych.router.errors import OpenAIError, from_backend
from triptych.router.event_pump import EventPump, coalesce
from triptych.router.logprobs import TokenText
from triptych.router.metrics import FrontendMetrics, RequestTimer
from triptych.router.responses import ChatCompletionResponse, CompletionResponse
from triptych.router.tools import ToolCallStream, parse_tool_calls
from triptych.stage_protocol import TokenLogprob
from triptych.stop_strings import StopMatcher

log = logging.getLogger("triptych.router.streaming")

DONE = b"data: [DONE]\n\n"
# Every choice finished: how long the backend may take to end its streams by itself
# before it is cancelled (normally the time to read the end of a worker's response).
END_GRACE_S = 1.0


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class Detokenizer(Protocol):
    """Incremental detokenization (the processor's `IncrementalDetokenizer`): `add` returns
    the newly completed text, holding back a character split across tokens; `flush` the
    rest at the end."""

    def add(self, token_ids: Sequence[int]) -> str: ...

    def flush(self) -> str: ...


class OutputText:
    """The text of one completion: detokenized, cut at the first stop string.

    `add` and `finish` return what may be sent to the client now; after a stop string is
    seen `stopped` is True and the caller ends the request (finish_reason 'stop'). The
    stop-string search and hold-back are `triptych.stop_strings.StopMatcher`'s, the same
    as the worker's engine."""

    def __init__(self, detokenizer: Detokenizer, stop: Sequence[str] = (), min_tokens: int = 0,
                 include_stop: bool = False) -> None:
        self._detok = detokenizer
        self.num_tokens = 0
        self._min_tokens = min_tokens  # stop strings count from there (vLLM's rule)
        self._matcher = StopMatcher(stop, include=include_stop)

    @property
    def stopped(self) -> bool:
        return self._matcher.stopped

    def add(self, token_ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        self.num_tokens += len(token_ids)
        if not token_ids:
            return ""
        return self._matcher.add(self._detok.add(list(token_ids)), check=self.num_tokens >= self._min_tokens)

    def finish(self) -> str:
        if self.stopped:
            return ""
        return self._matcher.add(self._detok.flush()) + self._matcher.flush()


# --- one request's response ---------------------------------------------------------------

STATUS_KEY = "triptych.status"  # ASGI scope key: a request's final status (streams end after the headers)
CLIENT_GONE = 499  # nginx's "client closed request"


@dataclass
class Choice:
    """One of the request's n sequences on its way out."""

    output: OutputText
    text_offset: int = 0  # completions' logprobs: where the next token's text starts
    finish: str | None = None
    backend_finished: bool = False  # the backend said it ended (not cut here: stop string, max_tokens)


@dataclass
class Job:
    """One admitted request on its way out: what the response needs to be built.

    `choices` holds one OutputText per sequence the backend generates (n, or best_of);
    `keep` of them are returned (best_of: the most likely by cumulative log-prob).
    `logprobs` says whether the client asked for them; `token_text` renders a token id."""

    request_id: str
    model: str
    chat: bool  # chat.completion(.chunk) or text_completion
    prompt_len: int
    max_tokens: int
    choices: list[Choice]
    metrics: FrontendMetrics
    timer: RequestTimer = field(default_factory=RequestTimer)
    return_token_ids: bool = False
    parse_tools: bool = False  # chat with tools: `<tool_call>` blocks become tool_calls (tools.py)
    created: int = field(default_factory=lambda: int(time.time()))
    logprobs: bool = False
    token_text: TokenText | None = None
    keep: int | None = None
    echo: str = ""  # vLLM's echo: text that opens every returned choice (the prompt, or chat's last message)

    @property
    def output(self) -> OutputText:
        return self.choices[0].output

    def render_logprobs(self, choice: Choice, entries: Sequence[TokenLogprob] | None) -> Any:
        """OpenAI's `logprobs` value for these tokens of `choice` (None unless asked for)."""
        if not self.logprobs:
            return None
        assert self.token_text is not None
        entries = entries or []
        if self.chat:
            return {"content": logprobs.chat_content(entries, self.token_text)}
        rendered, choice.text_offset = logprobs.completion_logprobs(entries, self.token_text, choice.text_offset)
        return rendered


@dataclass
class Piece:
    """What one backend event adds to choice `index`."""

    index: int
    text: str
    finish: str | None
    ids: list[int]
    logprobs: list[TokenLogprob] | None


async def _pieces(job: Job, pump: EventPump) -> AsyncIterator[Piece]:
    """Pieces as events arrive, until every choice has its finish_reason (the last piece
    of a choice carries it)."""
    live = len(job.choices)
    while live:
        event = await pump.next()
        if event is None:
            raise BackendError(502, "the backend ended the stream without a finish reason")
        event = coalesce(event, pump)
        if not 0 <= event.index < len(job.choices):
            raise BackendError(502, f"the backend sent choice {event.index} of {len(job.choices)}")
        choice = job.choices[event.index]
        if choice.finish is not None:  # cut here (stop string, max_tokens) while the backend went on
            continue
        out = choice.output
        ids = list(event.token_ids)[: max(0, job.max_tokens - out.num_tokens)]
        lps = event.logprobs[: len(ids)] if event.logprobs is not None else None
        job.metrics.observe_gaps(job.timer.tokens(len(ids)))
        piece = out.add(ids)
        finish = event.finish_reason
        if out.stopped:
            finish = "stop"
        elif finish is None and out.num_tokens >= job.max_tokens:
            finish = "length"  # the backend overran max_tokens: end it here
        if finish is not None:
            choice.finish = finish
            choice.backend_finished = event.finish_reason is not None
            live -= 1
            yield Piece(event.index, piece + out.finish(), finish, ids, lps)
        elif piece or (ids and (job.return_token_ids or job.logprobs)):
            yield Piece(event.index, piece, None, ids, lps)


def _end_grace(job: Job) -> float:
    """How long to let the backend end by itself: only when it finished every choice (a
    choice cut here leaves it generating: that is aborted at once)."""
    return END_GRACE_S if all(c.backend_finished for c in job.choices) else 0.0


def _usage(job: Job) -> dict[str, int]:
    n = sum(c.output.num_tokens for c in job.choices)
    return {"prompt_tokens": job.prompt_len, "completion_tokens": n, "total_tokens": job.prompt_len + n}


def _best(job: Job, scores: list[float]) -> list[int]:
    """The choices to return: all, or (best_of) the `keep` most likely, best first."""
    order = list(range(len(job.choices)))
    if job.keep is None or job.keep >= len(order):
        return order
    return sorted(order, key=lambda i: -scores[i])[: job.keep]


async def collect(job: Job, pump: EventPump) -> dict[str, Any]:
    """The whole completion as one chat.completion / text_completion object."""
    n = len(job.choices)
    text: list[list[str]] = [[] for _ in range(n)]
    token_ids: list[list[int]] = [[] for _ in range(n)]
    entries: list[list[TokenLogprob]] = [[] for _ in range(n)]
    try:
        async for piece in _pieces(job, pump):
            text[piece.index].append(piece.text)
            token_ids[piece.index] += piece.ids
            entries[piece.index] += piece.logprobs or []
        await pump.close(_end_grace(job))
    finally:
        await pump.close()
    _finished(job)
    scores = [sum(e.logprob for e in es) for es in entries]
    choices = [_choice_item(job, out_index, i, "".join(text[i]), entries[i])
               for out_index, i in enumerate(_best(job, scores))]
    if job.chat:
        body: Any = ChatCompletionResponse(id=job.request_id, created=job.created, model=job.model,
                                           usage=_usage(job), choices=choices)
    else:
        body = CompletionResponse(id=job.request_id, created=job.created, model=job.model, usage=_usage(job),
                                  choices=choices)
    data = body.model_dump()
    for item in data["choices"] if job.chat else []:
        if item["message"]["tool_calls"] is None:
            del item["message"]["tool_calls"]  # as OpenAI: no key when there is no call
    if job.return_token_ids:
        for item, i in zip(data["choices"], _best(job, scores), strict=True):
            item["token_ids"] = token_ids[i]
    return data


def _choice_item(job: Job, out_index: int, i: int, content: str, entries: list[TokenLogprob]) -> dict[str, Any]:
    """Choice `i` of a non-streaming response, returned at `out_index`; with tools, its
    `<tool_call>` blocks parsed into tool_calls (each choice on its own)."""
    choice = job.choices[i]
    lp = job.render_logprobs(choice, entries)
    if not job.chat:
        return {"index": out_index, "text": job.echo + content, "logprobs": lp, "finish_reason": choice.finish}
    message: dict[str, Any] = {"content": content, "tool_calls": None}
    finish = choice.finish
    if job.parse_tools:
        message["content"], calls = parse_tool_calls(content)
        if calls and finish == "stop":
            finish = "tool_calls"
        for call in calls:
            del call["index"]  # a message's calls carry no index (deltas do)
        message["tool_calls"] = calls or None
    if job.echo:
        message["content"] = job.echo + (message["content"] or "")
    return {"index": out_index, "message": message, "logprobs": lp, "finish_reason": finish}


def _finished(job: Job) -> None:
    job.metrics.generation_tokens.labels(job.model).inc(sum(c.output.num_tokens for c in job.choices))
    job.metrics.record_completion(job.timer)


def _chunk(job: Job, text: str | None, finish: str | None, include_usage: bool,
           role: bool = False, usage: dict[str, int] | None = None, ids: list[int] | None = None,
           index: int = 0, lps: Any = None, tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    if job.chat:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": lps, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": lps, "finish_reason": finish}
        obj = "text_completion"
    if job.return_token_ids and ids is not None:
        choice["token_ids"] = ids
    chunk: dict[str, Any] = {"id": job.request_id, "object": obj, "created": job.created,
                             "model": job.model, "choices": [choice]}
    if include_usage:
        chunk["usage"] = usage
    return chunk


def _feed_tools(calls: ToolCallStream, piece: Piece) -> list[dict[str, Any]]:
    """Run `piece` through its choice's tool-call parser: the piece keeps the text that is
    not a call (and finish_reason 'tool_calls' when it ends a choice that made calls);
    the new tool_call deltas are returned."""
    piece.text, new_calls = calls.feed(piece.text)
    if piece.finish is not None:
        piece.text += calls.finish()
        if calls.calls and piece.finish == "stop":
            piece.finish = "tool_calls"
    return new_calls


async def sse_body(job: Job, pump: EventPump, scope: dict[str, Any], include_usage: bool,
                   continuous: bool) -> AsyncIterator[bytes]:
    """The SSE body. Ends with `data: [DONE]` on success and on failure (after an error
    event); a client disconnect cancels it, and `pump.close` aborts the backend. The
    request's final status goes to `scope[STATUS_KEY]` for the front door's metrics."""
    def usage_now() -> dict[str, int] | None:
        return _usage(job) if continuous else None

    try:
        if job.chat:
            for index in range(len(job.choices)):
                yield sse(_chunk(job, "", None, include_usage, role=True, usage=usage_now(), index=index))
        for index in range(job.keep or len(job.choices)) if job.echo else ():
            yield sse(_chunk(job, job.echo, None, include_usage, usage=usage_now(), index=index))
        # With tools, each choice's text goes through its own tool-call parser (tools.py).
        streams = [ToolCallStream() if job.chat and job.parse_tools else None for _ in job.choices]
        async for piece in _pieces(job, pump):
            calls = streams[piece.index]
            new_calls: list[dict[str, Any]] = []
            if calls is not None:
                new_calls = _feed_tools(calls, piece)
                if not piece.text and not new_calls and piece.finish is None \
                        and not (piece.ids and (job.return_token_ids or job.logprobs)):
                    continue  # held back: maybe the start of a tool call
            lps = job.render_logprobs(job.choices[piece.index], piece.logprobs)
            yield sse(_chunk(job, piece.text, piece.finish, include_usage, usage=usage_now(), ids=piece.ids,
                             index=piece.index, lps=lps, tool_calls=new_calls))
        await pump.close(_end_grace(job))
        _finished(job)
        if include_usage:
            final = {"id": job.request_id, "object": "chat.completion.chunk" if job.chat else "text_completion",
                     "created": job.created, "model": job.model, "choices": [], "usage": _usage(job)}
            yield sse(final)
        scope[STATUS_KEY] = 200
    except asyncio.CancelledError:
        scope[STATUS_KEY] = CLIENT_GONE
        raise
    except Exception as exc:
        err = from_backend(exc) if isinstance(exc, BackendError) else None
        if err is None:
            log.exception("request %s failed mid-stream", job.request_id)
            err = OpenAIError(500, "internal server error", code="internal_error")
        scope[STATUS_KEY] = err.status_code
        yield sse(err.body())
    finally:
        await pump.close()
    yield DONE
