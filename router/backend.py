"""The seam between the HTTP layer and whatever moves a request through E -> P -> D.

The HTTP layer (api.py) validates and tokenizes a request, then hands a
`GenerationRequest` to a `Backend` and relays the `TokenEvent`s it yields. The
orchestrator implements `Backend`; tests implement it with scripted tokens.

Cancellation contract: when the client goes away (or the router has seen a stop string
or max_tokens), the HTTP layer cancels the task that iterates the backend's generator,
once: the generator sees one CancelledError at the await it is suspended in (asyncio's
edge-triggered kind, not anyio's repeating one), so awaits in its cleanup work. The
HTTP layer waits for that cleanup up to `RouterConfig.abort_timeout_s`. A generator
that was never started is just dropped (so start no work before the first `__anext__`).
The generator's `finally` / `except CancelledError` is where a backend aborts the
request on every stage and frees its blocks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from triptych.sampling_params import SamplingParams
from triptych.stage_protocol import TokenLogprob

if TYPE_CHECKING:
    from triptych.processor import MMItem

FinishReason = Literal["stop", "length"]


@dataclass
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    mm_items: list[MMItem]  # placeholder runs in prompt_token_ids, in image order
    images: list[bytes]  # original encoded bytes, one per mm item (E instances decode them)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    model: str = ""  # the served model name the client asked for
    grammar: str | None = None  # llguidance grammar masking every sampled token (router/structured.py)
    stream: bool = True  # False: the client takes the answer whole (its tokens may come in groups)


@dataclass
class TokenEvent:
    """New tokens of choice `index` (0..n-1). `finish_reason` is set on the choice's last
    event only; 'stop' = EOS, a stop token id or a stop string; 'length' = max_tokens
    reached. `logprobs` (one per token id) when the request asked for them."""

    token_ids: list[int]
    finish_reason: FinishReason | None = None
    index: int = 0
    logprobs: list[TokenLogprob] | None = None


class BackendError(Exception):
    """A failure the client should see with this HTTP status (429/500/503/504...).
    `retry_after` (seconds) becomes a Retry-After header on 429/503."""

    def __init__(self, status_code: int, message: str, retry_after: float | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.retry_after = retry_after
        self.code = code  # OpenAI's error `code`, when the failure names one (e.g. invalid_image)


@runtime_checkable
class Backend(Protocol):
    def generate(self, req: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Yield the request's tokens; raise BackendError on failure. Must start no work
        before the first `__anext__` (an async generator function satisfies this)."""
        ...

    async def health(self) -> dict[str, Any]:
        """{"status": "ok" | "degraded" | "unavailable", "roles": {"E": {"ready": 1, "total": 1}, ...}}"""
        ...

    def ready(self) -> bool:
        """True when a request could be served now (every stage has a ready instance)."""
        ...
