"""The internal API between the router and the workers (torch-free; the router imports it).

One endpoint runs a contiguous run of stages of one request on one instance
(`POST /internal/run`), answering with a stream of newline-delimited JSON events. The
router chains runs across instances: E -> P -> D, EP -> D, E -> PD, EPD, ...

The request goes as a binary frame (`encode_stage_request`, content type STAGE_FRAME_TYPE):
the StageRequest's JSON, then the raw bytes of the images and videos to encode there —
bulk data is never base64 inside JSON (a third larger, and encoded, copied and decoded
on both sides of every hop).

Hand-overs follow HydraInfer §4.3 (pull-based migration): the instance that ran a stage
answers with a *handle* (agent metadata + block ids + lease id) instead of the data; the
next instance allocates, READs the blocks over NIXL and notifies the source, which then
frees them. Handles are opaque to the router: it only carries them along.

A router sends the events of all its runs on one instance over one *event channel*
(`POST /internal/channel?id=...`, held open): a run posted with CHANNEL_HEADER is answered
at once, and its events follow on the channel as `<tag>\t<event>` lines (`channel_lines`).
One write a step carries every stream's tokens, where a stream per run would take one
each: on a CPU host each write is a syscall and a GIL hand-over the engine thread waits
behind (docs/benchmarks.md).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import AsyncIterator, Mapping
from typing import Annotated, Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator

from triptych.sampling_params import SamplingParams
from triptych.topology import Stage

Handle = dict[str, Any]  # a serialised transfer BlockHandle; opaque outside the worker

# Keep-alive: the router closes an idle connection to a worker well before the worker
# would. Were the two equal (httpx and uvicorn both default to 5 s), the router could send
# a stage call on a connection the worker is closing that instant, and the hop would fail
# with an empty ReadError although the worker is healthy.
ROUTER_KEEPALIVE_EXPIRY_S = 30.0
WORKER_KEEPALIVE_TIMEOUT_S = 75

CHANNEL_PATH = "/internal/channel"
CHANNEL_HEADER = "x-triptych-channel"  # "<channel id> <tag>": answer now, send the events on that channel
CHANNEL_GONE = "channel_gone"  # the error code of a run posted for a channel the instance no longer holds
# A silent channel carries an empty line this often, so that either side sees a dead peer
# (the router's read timeout on the channel is a few of these).
CHANNEL_KEEPALIVE_S = 15.0


class VideoOptions(BaseModel):
    """How the router sampled and sized a video (vLLM-style `mm_processor_kwargs`, resolved
    over the checkpoint's defaults): the encoder decodes the same frames at the same size,
    so its tokens match the placeholder run the router counted."""

    model_config = ConfigDict(extra="forbid")

    fps: float | None = None
    num_frames: int | None = None
    min_frames: int | None = None
    max_frames: int | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None

    def sampling(self) -> dict[str, Any]:
        """The frame-sampling keys (worker.video.SamplingOptions), unset ones left out."""
        keys = ("fps", "num_frames", "min_frames", "max_frames")
        return {k: v for k in keys if (v := getattr(self, k)) is not None}


# V instances (video decode, FlashCodec paper 000 §3): the router uploads a video's bytes
# to a V instance once (`PUT /internal/video/{video_id}`), then sends it GOP sets
# (`POST /internal/video/segment`); the V instance decodes and patchifies each set and
# answers with a `VideoPart`: a handle on its registered video buffer, pulled by the encode
# instance like an embedding (HydraInfer §4.3 pull-based migration: lease, READ, confirm).
VIDEO_ROWS_PER_BLOCK = 64  # patch rows per block of the video buffers (V source, E staging)
# ... at least: a block holds at least 64 Qwen patch rows' worth of floats (64 x 1176). Rows
# narrower than that (LLaVA's frames as images: one RGB pixel a row) get proportionally
# more rows per block, so a frame is tens of blocks (transfer descriptors), not thousands.
_VIDEO_BLOCK_MIN_FLOATS = VIDEO_ROWS_PER_BLOCK * 1176


def video_rows_per_block(patch_dim: int) -> int:
    """Rows per block of a video buffer whose rows are `patch_dim` floats wide (both ends
    of a V -> E hand-over compute it from the same patch width)."""
    return VIDEO_ROWS_PER_BLOCK * max(1, _VIDEO_BLOCK_MIN_FLOATS // (VIDEO_ROWS_PER_BLOCK * patch_dim))


# The error code of a V instance's 503 while it drains (shutting down): it takes no new
# upload or GOP set, so the router deals the set to another V instance instead.
VIDEO_DRAINING = "draining"


class VideoPart(BaseModel):
    """One decoded GOP set of a video as pixel patches held by a V instance."""

    index: int = Field(ge=0)  # the segment's position in the video
    num_frames: int = Field(ge=1)  # sampled frames it holds
    rows: int = Field(ge=1)  # patch rows: grid_thw[0] * grid_thw[1] * grid_thw[2]
    grid_thw: tuple[int, int, int]
    handle: Handle  # blocks of video_rows_per_block(patch width) rows in the V's "video" region


class VideoSegmentRequest(BaseModel):
    """Decode one GOP set (`segment`: a worker.video.Segment as JSON) of an uploaded video and
    patchify it with the item's resolved options (pixel bounds)."""

    request_id: str
    video_id: str
    segment: dict[str, Any]
    options: VideoOptions = VideoOptions()


class VideoFrame(BaseModel):
    """Where an image item comes from when a model takes a video's sampled frames as images
    (LLaVA, docs/video.md): frame `index` of the `count` frames sampled from the video whose
    MM key (`video_content_key`) is `video`. The frames of one video travel, are decoded and
    are planned as one unit (the video's bytes or V parts are sent once, under `video`)."""

    video: str
    index: int = Field(ge=0)
    count: int = Field(ge=1)


class MMItemSpec(BaseModel):
    """One image (or video) of a prompt, located by its placeholder run."""

    kind: Literal["image", "video"] = "image"
    offset: int = Field(ge=0)
    length: int = Field(ge=1)
    content_hash: str
    grid_thw: tuple[int, int, int] | None = None
    second_per_grid_t: float | None = None  # Qwen2.5-VL videos: M-RoPE temporal spacing
    video: VideoOptions | None = None  # videos: how to sample and size the frames
    # videos decoded on V instances: the parts to pull, in order (no bytes are sent then)
    video_parts: list[VideoPart] | None = None
    frame: VideoFrame | None = None  # an image that is a video's sampled frame (LLaVA)

    @property
    def unit(self) -> str:
        """What is planned, sent and decoded as one: a frame's video, else the item itself."""
        return self.frame.video if self.frame is not None else self.content_hash

    @classmethod
    def of(cls, item: Any) -> MMItemSpec:
        """From a `triptych.processor.MMItem` (the router's prompt items)."""
        video = getattr(item, "video_options", None)
        frame_of = getattr(item, "frame_of", None)
        frame = (VideoFrame(video=frame_of, index=item.frame_index, count=item.frame_count)
                 if frame_of is not None else None)
        return cls(kind=item.kind, offset=item.offset, length=item.length, content_hash=item.content_hash,
                   grid_thw=item.grid_thw, second_per_grid_t=getattr(item, "second_per_grid_t", None),
                   video=VideoOptions.model_validate(dict(video)) if video is not None else None, frame=frame)


def video_content_key(data: bytes, options: VideoOptions) -> str:
    """The MM cache key of a video item: its bytes AND how it was sampled and sized (the same
    clip at another fps or pixel bound is another embedding). The router names the item by it;
    the encode instance recomputes it from the bytes it is sent (a mismatch is refused)."""
    opts = json.dumps(options.model_dump(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(f"video:{hashlib.sha256(data).hexdigest()}:{opts}".encode()).hexdigest()


def frame_content_key(video_key: str, index: int) -> str:
    """The MM cache key of frame `index` of a video taken as images: derived from the video's
    key (bytes and sampling options), so it never collides with an image (sha256 of its
    bytes) nor with another video's frames."""
    return hashlib.sha256(f"frame:{video_key}:{index}".encode()).hexdigest()


class MMSource(BaseModel):
    """An embedding another instance holds: pull it instead of encoding again."""

    content_hash: str
    num_tokens: int
    handle: Handle


class TokenLogprob(BaseModel):
    """One sampled token's log-prob and the top alternatives (token id, log-prob), from the
    processed logits (worker/engine/sampling.py); the router renders OpenAI's shapes."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = []


class ChoiceStart(BaseModel):
    """An n > 1 request's first token of one more choice, sampled with the first token."""

    token: int
    logprob: TokenLogprob | None = None


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
    first_logprob: TokenLogprob | None = None  # first_token's, when the request asked for logprobs
    # n > 1 (one prefill, n decodes): the first tokens of choices 1..n-1 (choice 0's is
    # first_token). The decode instance pulls the KV once and forks it (worker/choices.py).
    choices: list[ChoiceStart] = []


class StageRequest(BaseModel):
    request_id: str
    stages: list[Stage] = Field(min_length=1)
    prompt_token_ids: list[int] = Field(min_length=1)
    mm_items: list[MMItemSpec] = []
    # The original image or video bytes, keyed by content hash: the items to encode here
    # (each item's `kind` says which). Never in the JSON: they travel as the frame's binary
    # tail (encode_stage_request), and a JSON `images` key is refused.
    images: dict[str, bytes] = Field(default={}, exclude=True)
    mm_sources: list[MMSource] = []
    kv_source: KVSource | None = None
    sampling: SamplingParams = SamplingParams()
    # An llguidance grammar (JSON or Lark text; structured output, forced tool calls): every
    # instance that samples for the request masks with it, a decode that takes over replays
    # the tokens sampled before it (worker/engine/guided.py).
    grammar: str | None = None
    timeout_s: float = Field(default=300.0, gt=0)
    # Token outputs the instance hands over at a time after the first (its own
    # `--stream-interval` when None): the router asks for many for a request its client
    # takes whole (stream=false), where nobody sees the tokens in between.
    stream_interval: int | None = Field(default=None, ge=1)


    @field_validator("images", mode="before")
    @classmethod
    def _bytes_only(cls, value: Any) -> Any:
        # JSON has no bytes: a JSON `images` (the old base64 form) would be read as the
        # base64 text's bytes; refuse it by name instead.
        if isinstance(value, Mapping) and not all(isinstance(v, bytes | bytearray | memoryview)
                                                  for v in value.values()):
            raise ValueError("images travel as the stage frame's binary tail, not in the JSON")
        return value


# The stage request frame: a 4-byte big-endian length and the StageRequest's JSON, then
# for each image or video to encode, a 2-byte key length, an 8-byte data length, the key
# (its content hash) and the raw bytes. Without images the frame is the header alone.
STAGE_FRAME_TYPE = "application/x-triptych-stage"
_FRAME_HEAD = struct.Struct(">I")
_BLOB_HEAD = struct.Struct(">HQ")


class StageFrameError(ValueError):
    """A body that is no well-formed stage request frame."""


def encode_stage_request(sreq: StageRequest) -> bytes:
    """`sreq` as its frame: the JSON header, then `sreq.images` as raw bytes."""
    head = sreq.model_dump_json().encode()
    parts = [_FRAME_HEAD.pack(len(head)), head]
    for key, data in sreq.images.items():
        name = key.encode()
        parts += [_BLOB_HEAD.pack(len(name), len(data)), name, data]
    return b"".join(parts)


def decode_stage_request(body: bytes) -> StageRequest:
    """A frame -> its StageRequest, `images` filled from the binary tail. StageFrameError
    when the framing is wrong; pydantic's ValidationError when the JSON is."""
    view = memoryview(body)
    if len(view) < _FRAME_HEAD.size:
        raise StageFrameError(f"stage frame of {len(view)} bytes has no header")
    (n,) = _FRAME_HEAD.unpack_from(view)
    pos = _FRAME_HEAD.size + n
    if pos > len(view):
        raise StageFrameError(f"stage frame header says {n} bytes of JSON; {len(view) - _FRAME_HEAD.size} follow")
    sreq = StageRequest.model_validate_json(bytes(view[_FRAME_HEAD.size:pos]))
    images: dict[str, bytes] = {}
    while pos < len(view):
        if pos + _BLOB_HEAD.size > len(view):
            raise StageFrameError(f"stage frame ends inside a blob header at byte {pos}")
        name_len, data_len = _BLOB_HEAD.unpack_from(view, pos)
        start = pos + _BLOB_HEAD.size + name_len
        end = start + data_len
        if end > len(view):
            raise StageFrameError(f"stage frame blob at byte {pos} says {data_len} bytes; fewer follow")
        try:
            key = str(view[pos + _BLOB_HEAD.size:start], "utf-8")
        except UnicodeDecodeError as exc:
            raise StageFrameError(f"stage frame blob key at byte {pos} is not UTF-8") from exc
        if key in images:
            raise StageFrameError(f"stage frame holds {key[:16]} twice")
        images[key] = bytes(view[start:end])
        pos = end
    sreq.images = images
    return sreq


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
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them
    index: int = 0  # the choice (n > 1)
    # The output index of token_ids[0]: sent by a live takeover (a make-before-break
    # migration), whose first event is an empty one (the decode is in its engine) and whose
    # tokens the router takes by index from the cut-over on (router/overlap.py).
    start: int | None = Field(default=None, ge=0)


class PrefilledEvent(BaseModel):
    type: Literal["prefilled"] = "prefilled"
    kv: KVSource


class MigratingEvent(BaseModel):
    """The instance hands a running decode to another decode instance (role switch or
    drain): every token so far was streamed; the router runs a decode hop elsewhere with
    `kv` as its kv_source and appends its tokens to the same stream."""

    type: Literal["migrating"] = "migrating"
    kv: KVSource
    index: int = 0  # the choice (n > 1)
    # Make-before-break: the instance goes on decoding the stream (its tokens keep coming
    # here) until the router closes it, right after a token it relayed once the decode's
    # next instance is ready; that instance gets the tokens relayed since (FeedRequest with
    # `lead`) and samples on. A router with no takeover for the decode closes it at once.
    live: bool = False


class FeedRequest(BaseModel):
    """One feed of `POST /internal/feed` (`FeedBatch`): output tokens a migrated decode's
    source sampled after its live hand-over (`MigratingEvent.live`), for the decode's takeover on this instance to
    follow (worker/engine/token_feed.py). Keyed by output index: repeats are no-ops.
    `lead`: the router cut over (the source is closed): the decode samples once it holds
    start + len(token_ids) tokens."""

    request_id: str
    start: int = Field(ge=0)  # the output index of token_ids[0]
    token_ids: list[int] = Field(default=[], max_length=4096)
    lead: bool = False

    @model_validator(mode="after")
    def _tokens_or_lead(self) -> FeedRequest:
        if not self.token_ids and not self.lead:
            raise ValueError("a feed carries tokens, or the lead")
        return self


MAX_FEEDS = 1024  # per `POST /internal/feed`


class FeedBatch(BaseModel):
    """`POST /internal/feed`'s body: the feeds the router sends one instance at once
    (router/feeds.py). The cut-overs of a switch come together — every decode moved off
    one instance reaches the cut on the same source step — and an instance handles one
    call for all of them where separate calls queue up behind its engine's steps."""

    feeds: list[FeedRequest] = Field(min_length=1, max_length=MAX_FEEDS)


class FeedReply(BaseModel):
    """`POST /internal/feed`'s answer: for each feed in order, whether a live takeover of
    that id runs here and took it (one that did not can never be cut over to)."""

    taken: list[bool]


class HandOver(KVSource):
    """A takeover's second line (router/takeover.py): the decode's KV as its source handed
    it over; `live`: the source goes on decoding (make-before-break), and the takeover
    samples nothing until the router cuts over (`FeedRequest.lead`)."""

    live: bool = False


class PrecopyEvent(BaseModel):
    """Live-migration pre-copy (a role switch or a drain about to move this decode): the
    instance still decodes the stream, and offers the KV blocks already full (they never
    change again) under a lease. The router opens the decode's next hop at once
    (`POST /internal/takeover`: its first NDJSON line is the hop's `StageRequest` with this
    `kv` as kv_source, which the instance pre-copies into its prefix cache); the hand-over
    of the `migrating` event that follows goes as the second line, on the open connection,
    and the instance pulls only the blocks it does not hold yet (the last, partial ones)."""

    type: Literal["precopy"] = "precopy"
    kv: KVSource  # the full blocks: num_tokens is a multiple of the block size
    index: int = 0  # the choice (n > 1)


class FinishedEvent(BaseModel):
    type: Literal["finished"] = "finished"
    finish_reason: Literal["stop", "length", "abort"]
    timings: dict[str, float] = {}
    index: int = 0  # the choice (n > 1); a run ends when each of its choices has finished


class ErrorEvent(BaseModel):
    type: Literal["error"] = "error"
    status: int = 500
    message: str


# One line of a `/internal/run` answer: the `type` field says which event it is. Each
# event is written as its own model's JSON (`event.model_dump_json()`), so the union
# changes nothing on the wire; readers parse a line with `parse_stage_event`.
StageEvent = Annotated[EncodedEvent | TokensEvent | PrefilledEvent | MigratingEvent | PrecopyEvent | FinishedEvent
                       | ErrorEvent,
                       Field(discriminator="type")]
STAGE_EVENT = TypeAdapter(StageEvent)


# The hot path: a decode sends one `tokens` event per stream per step (several tokens when
# the stream fell behind). Without log-probs those go through msgspec, which validates the
# same shape (list of ints, int index) at a fraction of pydantic's cost; the bytes are the
# same JSON object pydantic would write, so either side may use either codec.


class _TokensWire(msgspec.Struct, tag="tokens", tag_field="type"):
    token_ids: list[int]
    index: int = 0


class _FedTokensWire(msgspec.Struct, tag="tokens", tag_field="type"):
    """Any tokens line as read; as written, a fed decode's (`start` set: TokensEvent.start)."""

    token_ids: list[int]
    index: int = 0
    start: int | None = None


_TOKENS_DECODER = msgspec.json.Decoder(_FedTokensWire)
_ENCODER = msgspec.json.Encoder()
_TOKENS_PREFIX = b'{"type":"tokens"'


def encode_tokens_line(token_ids: list[int], index: int = 0) -> bytes:
    """A `tokens` event with neither log-probs nor `start` as its NDJSON line."""
    return _ENCODER.encode(_TokensWire(token_ids=token_ids, index=index)) + b"\n"


def encode_stage_event(event: BaseModel) -> bytes:
    """One event as its NDJSON line (newline included)."""
    if isinstance(event, TokensEvent) and event.logprobs is None:
        if event.start is None:
            return encode_tokens_line(event.token_ids, event.index)
        return _ENCODER.encode(_FedTokensWire(token_ids=event.token_ids, index=event.index, start=event.start)) + b"\n"
    return event.model_dump_json().encode() + b"\n"


def parse_stage_event(line: str | bytes) -> StageEvent:
    """One NDJSON line -> its event; pydantic's ValidationError when it is none of them."""
    raw = line.encode() if isinstance(line, str) else line
    if raw.startswith(_TOKENS_PREFIX) and b'"logprobs"' not in raw:
        try:
            wire = _TOKENS_DECODER.decode(raw)
        except msgspec.DecodeError:
            pass  # pydantic below says what is wrong, as a ValidationError
        else:  # validated by msgspec: skip pydantic's second pass
            if wire.start is not None and wire.start < 0:
                return STAGE_EVENT.validate_json(raw)  # pydantic says what is wrong
            return TokensEvent.model_construct(token_ids=wire.token_ids, index=wire.index, logprobs=None,
                                               start=wire.start)
    return STAGE_EVENT.validate_json(raw)


class RoleSwitch(BaseModel):
    role: str


async def ndjson_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The non-empty lines of a streamed NDJSON body (a takeover's request: the hop, then
    its hand-over), each as soon as it is complete."""
    pending = b""
    async for chunk in chunks:
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line.strip():
                yield line
    if pending.strip():
        yield pending


def channel_lines(tag: bytes, chunk: bytes) -> list[bytes]:
    """A run's NDJSON chunk as event-channel lines: each line prefixed with its run's tag.
    An empty chunk is the run's end (the tag and a tab alone)."""
    if not chunk:
        return [tag + b"\t\n"]
    return [tag + b"\t" + line + b"\n" for line in chunk.split(b"\n") if line]


def split_channel_line(line: str) -> tuple[str, str] | None:
    """(tag, event line) of an event-channel line; the event is empty at the run's end.
    None for a keep-alive (an empty line)."""
    tag, sep, event = line.partition("\t")
    return (tag, event) if sep else None
