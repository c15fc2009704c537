"""Stage-level batching (TriInfer §4.2, Algorithm 1; HydraInfer §4.2).

Every step builds one batch for one instance, whatever its type (E, P, D, EP, ED, PD,
EPD):

1. every running decode, one token each against the token budget (Alg. 1 lines 7-9);
2. chunks of running prefills up to the remaining token budget (lines 10-13);
3. encodes of running requests' pending images up to the image budget (lines 14-16);
4. waiting requests in arrival order: prefills fill the token budget, requests with images
   to encode fill the image budget (lines 17-24).

Encode and prefill share an iteration (TriInfer). A prefill chunk covers only positions
whose image embeddings are already in the MM cache, and may end inside an image span; the
embeddings computed in a step serve chunks from the next step on (so a request needs at
least two iterations to its first token, the reason for alpha = 0.5 in the budgets).

When KV blocks run out, the latest-arrived running request is preempted with recompute:
its blocks are freed and it goes back to the head of the queue; its prompt plus the tokens
it has generated are prefilled again later (vLLM's recompute preemption). Requests whose
KV was filled by another instance and whose image embeddings this engine never had cannot
be recomputed and are never chosen.

Automatic prefix caching (prefix_cache.py): when a waiting request is admitted for
prefill, it takes references to the cached blocks holding the longest prefix of its
tokens and starts computing after them (always at least its last token, whose logits give
the first sample). Full blocks it computes are registered after each step. A request
whose next uncached block is being computed right now by a running prefill waits for it
(one step, usually) instead of computing it a second time: a burst of requests sharing a
system prompt computes it once.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from triptych.topology import Stage
from triptych.worker.engine.batch import Chunk, ScheduledBatch
from triptych.worker.engine.kv_cache import KVCache
from triptych.worker.engine.mm_cache import MMCache
from triptych.worker.engine.request import Request, RequestStatus


@dataclass
class Counters:
    steps: int = 0
    preemptions: int = 0
    prefill_chunks: int = 0
    prefill_tokens: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0
    images_encoded: int = 0
    mm_cache_hits: int = 0
    handed_back: int = 0  # queued requests given back unstarted (role switch)
    migrated_out: int = 0  # decodes parked for another instance to go on with
    migrated_in: int = 0  # decodes taken over mid-stream from another instance
    prefix_cache_queries: int = 0  # tokens of admitted prefills looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found cached (not computed)

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


@dataclass
class QueuedWork:
    requests: int = 0
    tokens: int = 0  # prompt tokens still to prefill (prefill only)
    images: int = 0  # images still to encode (encode only)


@dataclass
class SchedulerConfig:
    token_budget: int
    image_budget: int
    max_num_seqs: int
    # Vision-encoder tokens (an item's placeholder tokens) a step may encode: UnifiedServe
    # §4.5 Alg. 3's alpha, which with the token budget (tau) bounds a step's compute on a
    # GPU shared with a decode instance. Items are admitted while budget is left, so one
    # image always runs and the last may overshoot (Alg. 3 lines 17-19). None: no limit.
    encode_token_budget: int | None = None


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCache | None, mm: MMCache | None) -> None:
        self.config = config
        self.kv = kv
        self.mm = mm
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # sorted by arrival
        self.parked: dict[str, Request] = {}
        self.counters = Counters()
        self._tokens_left = 0
        self._images_left = 0
        self._encode_tokens_left = 0
        self._prefill_blocked = False
        self._inflight: set[bytes] = set()  # hashes of blocks running prefills are computing

    # --- queue management -------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        if self.mm is not None:
            self._acquire_cached(req)
        if req.prefilled is not None:
            # Entry (b): blocks were reserved and filled by the caller; decode right away.
            self._insert_running(req)
        else:
            self.waiting.append(req)
        update_status(req, running=req.prefilled is not None)

    def remove(self, req: Request) -> None:
        """Take a request out of every queue and give back all its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.parked.pop(req.request_id, None)
        self._free_kv(req)
        if self.mm is not None:
            for i, entry in enumerate(req.mm_entries):
                if entry is not None:
                    self.mm.release(entry)
                    req.mm_entries[i] = None

    def park(self, req: Request) -> None:
        """A stage hand-off: out of the batch, resources kept until `remove`."""
        self.running.remove(req)
        self.parked[req.request_id] = req
        req.status = RequestStatus.PARKED

    def release_passed_mm(self, req: Request) -> None:
        """Drop MM refs of images the prefill has passed. The entry stays cached (and
        reusable) until evicted; only a request that can re-encode lets go, so a recompute
        never needs an embedding this engine cannot make again."""
        if self.mm is None or req.stop_after == Stage.ENCODE:
            return
        done = req.num_computed_tokens
        for i, (item, entry) in enumerate(zip(req.mm_items, req.mm_entries, strict=True)):
            if entry is not None and item.offset + item.length <= done and item.content_hash in req.images:
                self.mm.release(entry)
                req.mm_entries[i] = None

    def queued_work(self, arriving: Iterable[Request] = ()) -> dict[Stage, QueuedWork]:
        """Work waiting per stage (the planner's signals, EPDServe §3.2.4's queue lengths):
        requests not yet admitted, by the next stage they need here; images still to encode;
        prompt tokens still to prefill (admitted prefills' remaining chunks included).
        `arriving`: requests handed to the engine and not yet taken from its inbox."""
        out = {s: QueuedWork() for s in Stage}
        queued = [*self.waiting, *arriving]
        for req in [*queued, *self.running]:
            encodes = Stage.ENCODE in req.stages and self.mm is not None
            pending = len(req.pending_mm()) if encodes else 0
            out[Stage.ENCODE].images += pending
            if self._runs_prefill(req) and not req.prefill_done and req.prefilled is None:
                out[Stage.PREFILL].tokens += max(0, req.num_tokens - req.num_computed_tokens)
        for req in queued:
            if Stage.ENCODE in req.stages and self.mm is not None and req.pending_mm():
                out[Stage.ENCODE].requests += 1
            elif req.prefill_done or req.prefilled is not None:
                out[Stage.DECODE].requests += 1
            elif self._runs_prefill(req):
                out[Stage.PREFILL].requests += 1
        return out

    # --- Algorithm 1 ------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        self._tokens_left = self.config.token_budget
        self._images_left = self.config.image_budget
        self._encode_tokens_left = self.config.encode_token_budget or 1 << 62
        self._schedule_decodes(batch)
        self._schedule_running_prefills(batch)
        self._schedule_running_encodes(batch)
        self._admit_waiting(batch)
        return batch

    def _schedule_decodes(self, batch: ScheduledBatch) -> None:
        for req in list(self.running):
            if req.prefill_done and req in self.running:
                end = req.num_tokens
                # A migrated decode following its source (token_feed.py) samples nothing
                # until the cut-over: its last token waits (tokens fed before, if any, run).
                if req.feed is not None and req.feed.following(len(req.output_token_ids)):
                    end -= 1
                    if end <= req.num_computed_tokens:
                        continue
                if self._reserve_kv(req, end, batch):
                    # One token, or the tokens fed to a migrated decode (and its next).
                    batch.chunks.append(Chunk(req, req.num_computed_tokens, end))
                    self._tokens_left -= end - req.num_computed_tokens
                    if req.timings.first_scheduled is None:  # entered prefilled: its decode queue ends now
                        req.timings.first_scheduled = time.monotonic()

    def _schedule_running_prefills(self, batch: ScheduledBatch) -> None:
        for req in list(self.running):
            if self._tokens_left <= 0:
                return
            if req.prefill_done or req not in self.running or not self._runs_prefill(req):
                continue
            n = self._chunk_len(req)
            if n > 0 and self._reserve_kv(req, req.num_computed_tokens + n, batch):
                self._add_prefill_chunk(batch, req, n)

    def _schedule_running_encodes(self, batch: ScheduledBatch) -> None:
        for req in self.running:
            if req.pending_mm():  # a decode-only request (prefilled elsewhere) has none
                self._schedule_encodes(req, batch)

    def _admit_waiting(self, batch: ScheduledBatch) -> None:
        self._prefill_blocked = False  # FIFO: once one prefill waits for KV, later ones wait too
        self._inflight = self._blocks_in_flight()
        for req in list(self.waiting):
            if len(self.running) >= self.config.max_num_seqs:
                return
            looked_up = self._attach_cached_prefix(req)
            if looked_up is None:
                continue  # its next block is being computed by a running prefill: wait for it
            self._try_admit(req, batch)
            if req in self.waiting:
                self._detach(req)  # a waiting request holds no blocks (not preemptible)
            elif looked_up:
                self._count_hit(req)

    def _try_admit(self, req: Request, batch: ScheduledBatch) -> None:
        admitted = False
        if self._needs_encode(req):
            if self._images_left <= 0 or self._encode_tokens_left <= 0:
                return
            self._admit(req)
            self._schedule_encodes(req, batch)
            admitted = True  # its text before the first image may prefill right away
        elif not self._runs_prefill(req):
            self._admit(req)  # encode-only request whose embeddings were all cached
            return
        if self._prefill_blocked or self._tokens_left <= 0 or not self._runs_prefill(req):
            return
        n = self._chunk_len(req)
        if n <= 0:
            return  # waits for embeddings (being encoded, or pulled into the MM cache)
        assert self.kv is not None
        if not self.kv.can_allocate(self.kv.blocks_for(req.num_computed_tokens + n) - len(req.block_ids)):
            self._prefill_blocked = True
            return
        if not admitted:
            self._admit(req)
        self._reserve_kv(req, req.num_computed_tokens + n, batch)
        self._add_prefill_chunk(batch, req, n)

    # --- prefix caching ---------------------------------------------------------------
    def _caches_prefix(self, req: Request) -> bool:
        return (self.kv is not None and self.kv.prefix is not None and req.prefilled is None
                and req.stop_after != Stage.ENCODE)

    def _attach_cached_prefix(self, req: Request) -> bool | None:
        """Start a fresh prefill after its longest cached prefix: True if looked up, False
        if the request does not use the prefix cache, None if the block after its cached
        prefix is being computed by a running prefill (it waits, holding nothing)."""
        if not self._caches_prefix(req) or req.num_computed_tokens or req.block_ids:
            return False
        assert self.kv is not None
        # The last token is always computed: its hidden state gives the first sample.
        hashes = req.hashes_upto(req.num_tokens - 1, self.kv.block_size)
        hit = self.kv.cached_prefix(hashes)
        if len(hit) < len(hashes) and hashes[len(hit)] in self._inflight:
            return None
        self.kv.touch(hit)
        req.block_ids = list(hit)
        req.num_cached_blocks = len(hit)
        req.num_computed_tokens = len(hit) * self.kv.block_size
        return True

    def _detach(self, req: Request) -> None:
        self._free_kv(req)
        req.num_computed_tokens = 0

    def _count_hit(self, req: Request) -> None:
        assert self.kv is not None
        self.counters.prefix_cache_queries += req.num_tokens
        self.counters.prefix_cache_hits += req.num_cached_blocks * self.kv.block_size
        self._inflight.update(req.hashes_upto(req.num_tokens, self.kv.block_size)[req.num_cached_blocks:])

    def _blocks_in_flight(self) -> set[bytes]:
        if self.kv is None or self.kv.prefix is None:
            return set()
        return {h for r in self.running if not r.prefill_done and self._caches_prefix(r)
                for h in r.hashes_upto(r.num_tokens, self.kv.block_size)[r.num_cached_blocks:]}

    def cache_computed(self, req: Request) -> None:
        """Register the full blocks `req` has computed since the last call."""
        kv = self.kv
        if kv is None or kv.prefix is None or not self._caches_prefix(req):
            return
        full = min(req.num_computed_tokens // kv.block_size, len(req.block_ids))
        if full <= req.num_cached_blocks:
            return
        hashes = req.hashes_upto(full * kv.block_size, kv.block_size)
        for i in range(req.num_cached_blocks, full):
            kv.register(req.block_ids[i], hashes[i])
        req.num_cached_blocks = full

    # --- helpers ----------------------------------------------------------------------
    def _admit(self, req: Request) -> None:
        self.waiting.remove(req)
        self._insert_running(req)
        if req.timings.first_scheduled is None:
            req.timings.first_scheduled = time.monotonic()
        update_status(req, running=True)

    def _insert_running(self, req: Request) -> None:
        keys = [r.arrival_seq for r in self.running]
        self.running.insert(bisect.bisect(keys, req.arrival_seq), req)

    def _runs_prefill(self, req: Request) -> bool:
        return self.kv is not None and req.stop_after != Stage.ENCODE

    def _needs_encode(self, req: Request) -> bool:
        if self.mm is not None:
            self._acquire_cached(req)
        return bool(req.pending_mm())

    def _chunk_len(self, req: Request) -> int:
        start = req.num_computed_tokens
        end = min(req.num_tokens, req.mm_ready_limit(), start + self._tokens_left)
        return end - start

    def _add_prefill_chunk(self, batch: ScheduledBatch, req: Request, n: int) -> None:
        batch.chunks.append(Chunk(req, req.num_computed_tokens, req.num_computed_tokens + n))
        self._tokens_left -= n
        if req.timings.prefill_start is None:
            req.timings.prefill_start = time.monotonic()
        update_status(req, running=True, prefilling=True)

    def _acquire_cached(self, req: Request) -> None:
        """Attach already-cached embeddings (encoded earlier here, or pulled)."""
        assert self.mm is not None
        for i in req.pending_mm():
            entry = self.mm.acquire(req.mm_items[i].content_hash)
            if entry is not None:
                req.mm_entries[i] = entry
                self.counters.mm_cache_hits += 1

    def _schedule_encodes(self, req: Request, batch: ScheduledBatch) -> None:
        assert self.mm is not None
        self._acquire_cached(req)
        for i in req.pending_mm():
            if req.mm_entries[i] is not None:
                continue  # shares an entry allocated earlier in this loop
            if self._images_left <= 0 or self._encode_tokens_left <= 0:
                return
            item = req.mm_items[i]
            # What this run encodes: items sent as bytes, and videos pulled from V instances
            # as patches (ready vision inputs, no bytes).
            # A video's bytes without vision inputs: admission skipped decoding it because its
            # embedding was cached, and it was evicted since.
            if item.content_hash not in req.vision_inputs and (
                    item.kind == "video" or item.content_hash not in req.images):
                batch.failed.append((req, f"embeddings of image {item.content_hash[:16]} are no longer "
                                          "cached and the request carries no image to encode"))
                return
            if not self.mm.can_allocate(item.length):
                return  # the MM cache is full of embeddings in use; retry next step
            req.mm_entries[i] = self.mm.allocate(item.content_hash, item.length)
            batch.encodes.append((req, i))
            self._images_left -= 1
            self._encode_tokens_left -= item.length
            req.status = RequestStatus.ENCODING
            # Another item of this request with the same image shares the entry.
            for j in req.pending_mm():
                if req.mm_items[j].content_hash == item.content_hash:
                    req.mm_entries[j] = self.mm.acquire(item.content_hash)

    def _reserve_kv(self, req: Request, num_tokens: int, batch: ScheduledBatch) -> bool:
        """Make sure `req` has blocks for `num_tokens`, preempting later arrivals if needed.
        False when it cannot (it may have been preempted itself)."""
        assert self.kv is not None
        need = self.kv.blocks_for(num_tokens) - len(req.block_ids)
        while need > self.kv.num_free:
            victim = self._pick_victim(req)
            if victim is None:
                batch.blocked_on_kv.append(req)
                return False
            self._preempt(victim, batch)
            if victim is req:
                return False
        if need > 0:
            req.block_ids.extend(self.kv.allocate(need))
        return True

    def _pick_victim(self, req: Request) -> Request | None:
        for cand in reversed(self.running):  # latest arrival first
            if cand.recomputable and (cand.block_ids or cand is req):
                return cand
        return None

    def _preempt(self, victim: Request, batch: ScheduledBatch) -> None:
        for chunk in [c for c in batch.chunks if c.req is victim]:
            batch.chunks.remove(chunk)
            self._tokens_left += chunk.num_tokens
        self.running.remove(victim)
        self._free_kv(victim)
        victim.num_computed_tokens = 0  # a recompute finds its own blocks cached, if not evicted
        victim.prefill_done = False
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)
        self.counters.preemptions += 1
        update_status(victim, running=False)

    def _free_kv(self, req: Request) -> None:
        if self.kv is not None and req.block_ids:
            self.kv.free(req.block_ids)
        req.block_ids = []
        req.num_cached_blocks = 0


def update_status(req: Request, *, running: bool, prefilling: bool = False) -> None:
    """ENCODING while an image of the prompt is not ready (its text prefix may already be
    prefilling), PREFILLING once all embeddings are ready and a chunk ran."""
    if req.status in (RequestStatus.FINISHED, RequestStatus.PARKED):
        return
    if req.prefill_done:
        req.status = RequestStatus.DECODING
    elif req.mm_ready_limit() < req.num_tokens:  # an image still to encode (or pull) blocks it
        req.status = RequestStatus.ENCODING if running else RequestStatus.WAITING_ENCODE
    elif running and (prefilling or req.num_computed_tokens > 0):
        req.status = RequestStatus.PREFILLING
    else:
        req.status = RequestStatus.WAITING_PREFILL
