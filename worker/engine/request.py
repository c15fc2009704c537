"""One request's state inside an engine instance.

A request walks WAITING_ENCODE -> ENCODING -> WAITING_PREFILL -> PREFILLING -> DECODING ->
FINISHED; a request without images (or whose embeddings are already in this instance's MM
cache) starts at WAITING_PREFILL. Disaggregation needs requests that run only some of the
stages (HydraInfer §4.4): `stages` names the stages this instance runs for it.

- `stages = {ENCODE}`: encode the images, then PARK: the embeddings stay in the MM cache
  (refcounts held) until the serving layer calls `Engine.release`.
- `stages ⊇ {PREFILL}` without DECODE: prefill, sample the first token, then PARK with the
  KV blocks held until `release` (the D instance pulls them first).
- `stages = {DECODE}` (or PREFILL skipped): the prompt's KV was filled externally into
  blocks this engine reserved (`prefilled`), and the first token was sampled elsewhere.
- Without ENCODE, image embeddings must already be in this engine's MM cache (pulled from
  an E instance); they are found by content hash.

The token sequence is unified as in vLLM v1: `all_token_ids = prompt + outputs`, and
`num_computed_tokens` of them have KV in the cache. Each step computes a span of the
uncomputed tokens; when a span reaches the end, the next token is sampled. A decode is the
one-token case, and a recompute after preemption is a prefill of prompt + outputs so far.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

from triptych import processor
from triptych.prefix_hash import extend_chain
from triptych.sampling_params import SamplingParams
from triptych.stop_strings import StopMatcher
from triptych.topology import Stage

if TYPE_CHECKING:
    import torch

    from triptych.worker.engine.mm_cache import MMEntry
    from triptych.worker.engine.token_feed import TokenFeed

ALL_STAGES: frozenset[Stage] = frozenset(Stage)


class RequestStatus(StrEnum):
    WAITING_ENCODE = "waiting_encode"
    ENCODING = "encoding"
    WAITING_PREFILL = "waiting_prefill"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    PARKED = "parked"  # a stage hand-off: resources held until Engine.release
    FINISHED = "finished"


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


# --- errors raised at add_request -------------------------------------------------------


class RequestValidationError(ValueError):
    """A request this engine cannot run; the message says why. Other requests are unaffected."""


class PromptTooLongError(RequestValidationError):
    pass


class InvalidImageError(RequestValidationError, processor.InvalidImageError):
    """Bytes that are not a (complete) image."""


class ImageTooLargeError(RequestValidationError, processor.ImageTooLargeError):
    """An image over the configured pixel limit."""


class MissingEmbeddingError(RequestValidationError):
    """An image that is neither given (to encode here) nor in this engine's MM cache."""


# The error of a queued request an instance gives back unstarted when it switches roles
# (the router runs it elsewhere; worker/errors.py maps it to a retriable 503).
HANDED_BACK = "handed back: the instance is switching roles"


class StageNotServedError(RequestValidationError):
    """The request needs a stage this instance's role does not run."""


class MMItemLike(Protocol):
    """`triptych.processor.MMItem` or `triptych.stage_protocol.MMItemSpec`: a placeholder run."""

    offset: int
    length: int
    content_hash: str
    grid_thw: tuple[int, int, int] | None


@dataclass
class PrefilledKV:
    """Entry point (b): the prompt's KV was written into `block_ids` of this engine's KV
    cache by someone else (a P instance, over NIXL); `first_token` was sampled there."""

    block_ids: list[int]
    num_tokens: int
    first_token: int
    # A decode migrated mid-stream (EPDServe §3.2.4): the output tokens sampled before
    # `first_token`; the KV holds prompt + generated, and the stream goes on from there.
    generated: list[int] = field(default_factory=list)


@dataclass
class RequestTimings:
    arrival: float = 0.0
    first_scheduled: float | None = None
    encode_start: float | None = None
    encode_end: float | None = None
    prefill_start: float | None = None
    prefill_end: float | None = None
    first_token: float | None = None
    finished: float | None = None
    token_times: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, float]:
        out = {k: v for k, v in vars(self).items() if isinstance(v, float)}
        if self.first_scheduled is not None:
            out["queue"] = self.first_scheduled - self.arrival
        if self.first_token is not None:
            out["ttft"] = self.first_token - self.arrival
        return out


@dataclass
class Handoff:
    """What a PARKED request holds for the next instance to pull (HydraInfer §4.3)."""

    stage: Stage
    kv_block_ids: list[int] = field(default_factory=list)
    num_kv_tokens: int = 0
    first_token: int | None = None
    generated: list[int] = field(default_factory=list)  # DECODE: outputs before first_token
    # (content_hash, block_ids, num_rows) per distinct image embedding
    mm: list[tuple[str, list[int], int]] = field(default_factory=list)
    # DECODE handed over live (make-before-break, token_feed.py): the decode goes on here
    # and these references (precopy.HeldKV) keep its blocks as they were until the pull.
    held: Any = None


@dataclass
class RequestOutput:
    """A delta: what one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str = ""
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    handoff: Handoff | None = None
    logprobs: list[dict[str, Any]] | None = None
    precopy: bool = False  # offer this decode's full KV blocks for a pre-copy (Engine.precopy)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    timings: dict[str, float] | None = None


_arrival_counter = itertools.count()


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    mm_items: Sequence[MMItemLike] = ()
    # Images to encode here, keyed by content hash (PIL.Image or encoded bytes).
    images: Mapping[str, Any] = field(default_factory=dict)
    stages: frozenset[Stage] = ALL_STAGES
    prefilled: PrefilledKV | None = None
    # An llguidance grammar (guided.py) that masks every token sampled for the request.
    grammar: str | None = None
    # Token outputs handed to the stream at a time after the first (driver.py); None: the
    # engine's `stream_interval`. The router asks for more for a request taken whole.
    stream_interval: int | None = None

    # --- runtime state, owned by the engine -------------------------------------------
    status: RequestStatus = field(default=RequestStatus.WAITING_PREFILL, init=False)
    output_token_ids: list[int] = field(default_factory=list, init=False)
    num_computed_tokens: int = field(default=0, init=False)
    prefill_done: bool = field(default=False, init=False)
    block_ids: list[int] = field(default_factory=list, init=False)
    # Prefix caching (prefix_cache.py): the hash chain of the full blocks of all_token_ids
    # (grown as tokens come), and how many of block_ids are registered in the cache.
    block_hashes: list[bytes] = field(default_factory=list, init=False)
    num_cached_blocks: int = field(default=0, init=False)
    mm_entries: list[MMEntry | None] = field(default_factory=list, init=False)
    vision_inputs: dict[str, Any] = field(default_factory=dict, init=False)  # hash -> VisionInput
    seed: int | None = field(default=None, init=False)  # resolved at admission
    finish_reason: FinishReason | None = field(default=None, init=False)
    error: str | None = field(default=None, init=False)
    arrival_seq: int = field(default_factory=lambda: next(_arrival_counter), init=False)
    timings: RequestTimings = field(default_factory=RequestTimings, init=False)
    positions: torch.Tensor | None = field(default=None, init=False)  # prompt positions
    rope_delta: int = field(default=0, init=False)
    recomputable: bool = field(default=True, init=False)
    handoff: Handoff | None = field(default=None, init=False)  # set when PARKED
    num_preemptions: int = field(default=0, init=False)
    # The Admission that prepared the request ahead of `add_request` (a decode's stage run
    # does it while the KV pull is in flight): add_request then checks only the blocks.
    prepared_by: object | None = field(default=None, init=False, repr=False)
    # text state (see outputs.py): detokenized as tokens come when `detok` is set (stop
    # strings, or streamed text), else decoded from the token ids when `text` is read
    text_parts: list[str] = field(default_factory=list, init=False)
    sent_text_len: int = field(default=0, init=False)  # parts already in an output
    sent_token_len: int = field(default=0, init=False)
    detok: processor.IncrementalDetokenizer | None = field(default=None, init=False)
    stop_matcher: StopMatcher | None = field(default=None, init=False)
    decode_text: Callable[[list[int]], str] | None = field(default=None, init=False)
    logprobs: list[dict[str, Any]] = field(default_factory=list, init=False)
    sent_logprobs_len: int = field(default=0, init=False)
    # n > 1: the first tokens (and log-prob entries) of choices 1..n-1, sampled with the
    # first token from the same logits (model_runner.py); worker/choices.py forks them.
    choice_firsts: list[tuple[int, dict[str, Any] | None]] = field(default_factory=list, init=False)
    guide: Any = field(default=None, init=False)  # guided.Guide, built at admission from `grammar`
    # Make-before-break migration (token_feed.py): `moves_live`, set by a stream that can
    # merge two instances' tokens, lets a switch hand the decode over while it goes on
    # here (`handed_over_live` once it was); `feed`, on the decode's next instance, what
    # the router's cut-over brings (the tokens the source streamed meanwhile).
    moves_live: bool = field(default=False, init=False)
    handed_over_live: bool = field(default=False, init=False)
    feed: TokenFeed | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.stages = frozenset(Stage(s) for s in self.stages)
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.mm_items = sorted(self.mm_items, key=lambda it: it.offset)
        self.mm_entries = [None] * len(self.mm_items)
        self.timings.arrival = time.monotonic()

    # --- derived --------------------------------------------------------------------
    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def text(self) -> str:
        """The generated text (cut at a stop string). Streamed requests hold back a tail
        that could still start a stop string until they finish."""
        if self.detok is not None:
            return "".join(self.text_parts)
        return self.decode_text(self.output_token_ids) if self.decode_text is not None else ""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def stop_after(self) -> Stage:
        """The last stage this instance runs for the request."""
        for stage in (Stage.DECODE, Stage.PREFILL, Stage.ENCODE):
            if stage in self.stages:
                return stage
        raise RequestValidationError("a request needs at least one stage")

    def hashes_upto(self, num_tokens: int, block_size: int) -> list[bytes]:
        """The block hash chain over the first `num_tokens` tokens (full blocks only)."""
        if len(self.block_hashes) < num_tokens // block_size:
            extend_chain(self.block_hashes, self.all_token_ids, self.mm_items, block_size, num_tokens)
        return self.block_hashes[:num_tokens // block_size]

    def token_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    def pending_mm(self) -> list[int]:
        """Items still to be computed that hold no MM cache entry yet."""
        done = self.num_computed_tokens
        return [i for i, (item, e) in enumerate(zip(self.mm_items, self.mm_entries, strict=True))
                if e is None and item.offset + item.length > done]

    def mm_ready_limit(self) -> int:
        """Prefill may compute tokens below this index: the first item without ready
        embeddings bounds it (a chunk can stop inside an image span of a ready item)."""
        for item, entry in zip(self.mm_items, self.mm_entries, strict=True):
            if entry is None or not entry.ready:
                if item.offset + item.length > self.num_computed_tokens:
                    return item.offset
        return self.num_tokens
