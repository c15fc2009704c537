"""The internal API between the router and the workers (torch-free; the router imports it).

One endpoint runs a contiguous run of stages of one request on one instance
(`POST /internal/run`), answering with a stream of newline-delimited JSON events. The
router chains runs across instances: E -> P -> D, EP -> D, E -> PD, EPD, ...

Hand-overs follow HydraInfer §4.3 (pull-based migration): the instance that ran a stage
answers with a *handle* (agent metadata + block ids + lease id) instead of the data; the
next instance allocates, READs the blocks over NIXL and notifies the source, which then
frees them. Handles are opaque to the router: it only carries them along.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, TypeAdapter

from triptych.sampling_params import SamplingParams
from triptych.topology import Stage

Handle = dict[str, Any]  # a serialised transfer BlockHandle; opaque outside the worker


class MMItemSpec(BaseModel):
    """One image (or video) of a prompt, located by its placeholder run."""

    kind: Literal["image", "video"] = "image"
    offset: int = Field(ge=0)
    length: int = Field(ge=1)
    content_hash: str
    grid_thw: tuple[int, int, int] | None = None


class MMSource(BaseModel):
    """An embedding another instance holds: pull it instead of encoding again."""

    content_hash: str
    num_tokens: int
    handle: Handle


class KVSource(BaseModel):
    """A prefilled KV cache on another instance plus the token it sampled first.

    A decode migrated mid-stream (a role switch or a drain; EPDServe §3.2.4) also names the
    output tokens sampled before `first_token` (`generated`): the KV then holds prompt +
    generated, `first_token` is the last token sampled, and the decode instance that pulls
    it goes on at output index len(generated) + 1 (seeds, max_tokens and stops continue)."""

    handle: Handle
    num_tokens: int
    first_token: int
    generated: list[int] = []


class StageRequest(BaseModel):
    request_id: str
    stages: list[Stage] = Field(min_length=1)
    prompt_token_ids: list[int] = Field(min_length=1)
    mm_items: list[MMItemSpec] = []
    # base64 of the original image bytes, keyed by content hash: the items to encode here.
    images: dict[str, str] = {}
    mm_sources: list[MMSource] = []
    kv_source: KVSource | None = None
    sampling: SamplingParams = SamplingParams()
    timeout_s: float = Field(default=300.0, gt=0)


class EncodedItem(BaseModel):
    content_hash: str
    num_tokens: int
    handle: Handle


class EncodedEvent(BaseModel):
    type: Literal["encoded"] = "encoded"
    items: list[EncodedItem]


class TokensEvent(BaseModel):
    type: Literal["tokens"] = "tokens"
    token_ids: list[int]


class PrefilledEvent(BaseModel):
    type: Literal["prefilled"] = "prefilled"
    kv: KVSource


class MigratingEvent(BaseModel):
    """The instance hands a running decode to another decode instance (role switch or
    drain): every token so far was streamed; the router runs a decode hop elsewhere with
    `kv` as its kv_source and appends its tokens to the same stream."""

    type: Literal["migrating"] = "migrating"
    kv: KVSource


class FinishedEvent(BaseModel):
    type: Literal["finished"] = "finished"
    finish_reason: Literal["stop", "length", "abort"]
    timings: dict[str, float] = {}


class ErrorEvent(BaseModel):
    type: Literal["error"] = "error"
    status: int = 500
    message: str


# One line of a `/internal/run` answer: the `type` field says which event it is. Each
# event is written as its own model's JSON (`event.model_dump_json()`), so the union
# changes nothing on the wire; readers parse a line with `parse_stage_event`.
StageEvent = Annotated[EncodedEvent | TokensEvent | PrefilledEvent | MigratingEvent | FinishedEvent | ErrorEvent,
                       Field(discriminator="type")]
STAGE_EVENT = TypeAdapter(StageEvent)


def parse_stage_event(line: str | bytes) -> StageEvent:
    """One NDJSON line -> its event; pydantic's ValidationError when it is none of them."""
    return STAGE_EVENT.validate_json(line)


class RoleSwitch(BaseModel):
    role: str
