"""Helpers for the router's HTTP-layer tests: a scripted Backend (a test double standing
in for the orchestrator, which has its own end-to-end tests), images, SSE parsing."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from hf_reference import png_bytes as _encode_png
from PIL import Image

from triptych.processor import MultimodalProcessor
from triptych.router.backend import BackendError, GenerationRequest, TokenEvent

REPLY = "Hello there, world!"


@dataclass
class ScriptedBackend:
    """Serves scripted token events. `script(req)` returns the events for a request;
    `fail_before_first` / `fail_after` raise BackendError at that point; `delay_s` sleeps
    before each event. Records every request and whether its iterator was cancelled."""

    script: Callable[[GenerationRequest], list[TokenEvent]]
    delay_s: float = 0.0
    fail_before_first: BackendError | None = None
    fail_after: tuple[int, BackendError] | None = None  # raise after this many events
    health_report: dict[str, Any] = field(default_factory=lambda: {"status": "ok", "roles": {}})
    is_ready: bool = True
    requests: list[GenerationRequest] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    started: asyncio.Event = field(default_factory=asyncio.Event)

    async def generate(self, req: GenerationRequest) -> AsyncIterator[TokenEvent]:
        self.requests.append(req)
        self.started.set()
        try:
            if self.fail_before_first is not None:
                await asyncio.sleep(self.delay_s)
                raise self.fail_before_first
            for n, event in enumerate(self.script(req)):
                if self.fail_after is not None and n == self.fail_after[0]:
                    raise self.fail_after[1]
                await asyncio.sleep(self.delay_s)
                yield event
            self.finished.append(req.request_id)
        except asyncio.CancelledError:
            # An abort awaits (HTTP calls to the workers): recorded only once that await
            # completed, so the tests also check cleanup is not cut short by re-cancellation.
            await asyncio.sleep(0.02)
            self.cancelled.append(req.request_id)
            raise
        except GeneratorExit:
            self.closed.append(req.request_id)
            raise

    async def health(self) -> dict[str, Any]:
        return self.health_report

    def ready(self) -> bool:
        return self.is_ready


def reply_events(processor: MultimodalProcessor, text: str = REPLY, per_event: int = 1,
                 finish: str = "stop", eos: bool = True) -> list[TokenEvent]:
    ids = processor.encode(text) + ([processor.eos_token_ids[0]] if eos else [])
    events = [TokenEvent(ids[i:i + per_event]) for i in range(0, len(ids), per_event)]
    events[-1].finish_reason = finish  # type: ignore[assignment]
    return events


def solid_png(width: int = 32, height: int = 24, color: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    """PNG bytes of a one-colour image (hf_reference.png_bytes encodes any PIL image)."""
    return _encode_png(Image.new("RGB", (width, height), color))


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def image_part(data: bytes | None = None, url: str | None = None) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url or data_url(data or solid_png())}}


def parse_sse(body: str) -> list[Any]:
    """The `data:` payloads of an SSE body, JSON-decoded except the final [DONE]; asserts
    the framing (every event is one `data: ` line followed by a blank line)."""
    assert body.endswith("\n\n"), body[-50:]
    out: list[Any] = []
    for block in body.split("\n\n")[:-1]:
        assert block.startswith("data: ") and "\n" not in block, block
        payload = block[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def chat_body(content: Any = "Say hello", **extra: Any) -> dict[str, Any]:
    return {"model": "tiny-qwen", "messages": [{"role": "user", "content": content}], **extra}


def metric_value(text: str, sample: str, **labels: str) -> float | None:
    """The value of one sample in Prometheus text output (None when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None
