"""The orchestrator's settings and its per-request bookkeeping, shared by the request path
(orchestrator.py) and the decode chain (decode_chain.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from triptych.router.backend import GenerationRequest
from triptych.router.overhead import WaitClock
from triptych.topology import Stage

# Encode-only runs go by their own id on the worker: the same instance may run a later hop
# of the request (an ED instance decodes what it encoded) while the encode run is still
# parked until its lease is released, and a worker's engine keys requests by id.
ENCODE_ID_SUFFIX = ".encode"

@dataclass
class OrchestratorConfig:
    stage_timeout_s: float = 60.0  # longest silence allowed on a stage stream
    max_attempts: int = 3  # tries of the pre-first-token part of a request
    parallel_encode: bool = True  # EPDServe §3.2.2 intra-request parallelism
    cache_affinity: bool = True  # send an image to the instance whose MM cache holds it
    affinity_entries: int = 4096  # image hashes remembered (an LRU; a stale entry only costs an encode)
    prefix_routing: bool = True  # prefill where the prompt's prefix is likely cached (routing.PrefixRouting)
    prefix_weight: float = 8.0  # queued requests a whole-prompt cache hit is worth
    prefix_min_tokens: int = 64  # shorter hits (a chat template's header) leave the choice to the policy
    prefix_entries: int = 1 << 18  # prompt block hashes remembered (an LRU; a stale one costs a prefill)
    abort_timeout_s: float = 2.0
    per_token_timeout_s: float = 1.0  # a decode hop's deadline grows with max_tokens
    max_inflight: int = 512  # requests in flight before new ones get 429
    max_instance_load: float | None = None  # 429 when every first-stage instance reports more queued work
    retry_after_s: float = 1.0
    max_decode_hops: int = 8  # times one decode may migrate to another instance
    # With a KV in hand (its source holds it under a lease) and no decode instance taking
    # it — all switching, refusing, or unseen by the registry for a moment — wait this
    # long for one before failing the request.
    decode_wait_s: float = 10.0
    # A request planned while every instance of a stage it needs is mid-switch (the only P
    # or D changing role) waits this long — never past stage_timeout_s — for one to come
    # back, instead of a 503; with none switching, the 503 is at once.
    plan_wait_s: float = 10.0
    # Tokens a worker hands over at a time (after the first) for a request the client takes
    # whole (stream=false; vLLM sends such a request's output once, at its end): fewer
    # events for the worker's event loop and the router to carry; stop strings, max_tokens
    # and migrations flush what is held.
    whole_interval: int = 16
    # Runs on a worker send their events over the one event channel the router holds open
    # to it (router/stage_channel.py), not each in its own response: a write a step for
    # all of them. Off: a stream per run.
    stage_channel: bool = True


@dataclass
class Footprint:
    """Where a request has been: every instance a call went to, and the request's id of
    each attempt (an encode-only run used that id + ENCODE_ID_SUFFIX). Aborts go to all."""

    urls: set[str] = field(default_factory=set)
    ids: list[str] = field(default_factory=list)
    waits: WaitClock = field(default_factory=WaitClock)  # time spent waiting on workers (overhead.py)

    def abort_ids(self) -> list[str]:
        return [i + suffix for i in self.ids for suffix in ("", ENCODE_ID_SUFFIX)]


def stream_interval(config: OrchestratorConfig, req: GenerationRequest) -> int | None:
    """What a stage request asks of its worker's stream interval (None: the worker's own)."""
    return None if req.stream else config.whole_interval


def hop_deadline(config: OrchestratorConfig, stages: Sequence[Stage], req: GenerationRequest) -> float:
    """The worker-side deadline of one hop: a stage's budget, plus time per token to
    decode (silence is caught sooner, by the stream's read timeout)."""
    budget = config.stage_timeout_s
    if Stage.DECODE in stages:
        budget += req.sampling.max_tokens * config.per_token_timeout_s
    return budget
