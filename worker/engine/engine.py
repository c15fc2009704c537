"""The inference engine of one instance: caches, scheduler, model step, asyncio driver.

`Engine.step()` runs one iteration of stage-level batching (scheduler.py): the encodes of
the batch run through the vision tower into the MM cache, then every prefill chunk and
every decode runs in ONE language-model forward over the paged KV cache, and the rows
that end a sequence are sampled. `step()` is synchronous and single-threaded; the asyncio
driver (`start()` / `generate()`) runs it on a background thread while there is work.

Requests enter through `add_request`, which validates them in the caller's thread (typed
`RequestValidationError`s) and hands them to the loop through an inbox; aborts and releases
go through the inbox too, so a request's blocks are never freed while a forward writes
them. Serving reserves cache blocks for pulled data with `reserve_kv` / `reserve_mm`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from triptych import processor
from triptych.sampling_params import SamplingParams
from triptych.topology import InstanceType, Stage
from triptych.worker.attention import build_metadata
from triptych.worker.engine.inputs import decode_image
from triptych.worker.engine.kv_cache import KVCache, OutOfBlocksError, blocks_for
from triptych.worker.engine.mm_cache import MMCache, MMEntry
from triptych.worker.engine.request import (
    FinishReason,
    Handoff,
    MissingEmbeddingError,
    PromptTooLongError,
    Request,
    RequestOutput,
    RequestStatus,
    RequestValidationError,
    StageNotServedError,
)
from triptych.worker.engine.sampling import SampleRow, resolve_seed, sample
from triptych.worker.engine.scheduler import Chunk, ScheduledBatch, Scheduler, SchedulerConfig, update_status

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    role: InstanceType = InstanceType.EPD
    dtype: str = Field(default="float32", pattern="^(float32|float16|bfloat16)$")
    device: str = "cpu"
    block_size: int = Field(default=16, ge=1)
    num_kv_blocks: int | None = Field(default=None, ge=1)
    kv_cache_bytes: int = Field(default=512 << 20, ge=1)  # used when num_kv_blocks is unset
    mm_block_rows: int = Field(default=64, ge=1)
    num_mm_blocks: int | None = Field(default=None, ge=1)
    mm_cache_bytes: int = Field(default=128 << 20, ge=1)
    max_num_seqs: int = Field(default=64, ge=1)
    token_budget: int | None = Field(default=None, ge=1)
    image_budget: int | None = Field(default=None, ge=1)
    ttft_slo_s: float | None = Field(default=None, gt=0)  # budgets by profiling (profiler.py)
    tbt_slo_s: float | None = Field(default=None, gt=0)
    max_model_len: int | None = Field(default=None, ge=2)
    max_image_pixels: int = Field(default=4096 * 4096, ge=1)
    detokenize: bool = True  # stop strings always detokenize
    threads: int | None = Field(default=None, ge=1)
    # Tests: scramble the free lists so block tables are non-contiguous.
    shuffle_seed: int | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


DEFAULT_TOKEN_BUDGET = 2048
DEFAULT_IMAGE_BUDGET = 8


class Engine:
    def __init__(self, config: EngineConfig, model: Any = None) -> None:
        from triptych.worker.models.loader import load_model

        self.config = config
        self.role = config.role
        if config.threads:
            torch.set_num_threads(config.threads)
        self.model = model or load_model(
            config.model, vision=self.role.needs_vision, language=self.role.needs_language,
            dtype=config.torch_dtype, device=config.device)
        self.spec = self.model.spec
        self.vision = self.model.vision
        self.language = self.model.language
        self.device = torch.device(config.device)
        self.max_model_len = min(config.max_model_len or self.spec.max_model_len, self.spec.max_model_len)
        self.tokenizer = _load_tokenizer(Path(config.model))
        self.eos_ids = frozenset(self.spec.eos_token_ids)
        self.kv = self._make_kv_cache() if self.language is not None else None
        self.mm = self._make_mm_cache() if self.role.runs(Stage.ENCODE) or self.role.runs(Stage.PREFILL) else None
        self._requests: dict[str, Request] = {}
        self._known_ids: set[str] = set()  # added and not finished (inbox included)
        self._inbox: deque[tuple[str, Any]] = deque()
        self._lock = threading.RLock()  # guards caches and queues against reserve_* callers
        budgets = self._budgets()
        self.scheduler = Scheduler(SchedulerConfig(budgets[0], budgets[1], config.max_num_seqs), self.kv, self.mm)
        # asyncio driver
        self._sinks: dict[str, Any] = {}
        self._wakeup = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False

    # --- set-up -----------------------------------------------------------------------
    def _make_kv_cache(self) -> KVCache:
        cfg, spec = self.config, self.spec
        per_block = spec.num_layers * 2 * cfg.block_size * spec.num_kv_heads * spec.head_dim
        per_block *= torch.empty(0, dtype=cfg.torch_dtype).element_size()
        n = cfg.num_kv_blocks
        if n is None:
            enough = cfg.max_num_seqs * blocks_for(self.max_model_len, cfg.block_size)
            n = max(1, min(cfg.kv_cache_bytes // per_block, enough))
        return KVCache(num_blocks=n, num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
                       head_dim=spec.head_dim, block_size=cfg.block_size, dtype=cfg.torch_dtype,
                       device=cfg.device, shuffle_seed=cfg.shuffle_seed)

    def _make_mm_cache(self) -> MMCache:
        cfg, spec = self.config, self.spec
        per_block = cfg.mm_block_rows * spec.hidden_size * torch.empty(0, dtype=cfg.torch_dtype).element_size()
        n = cfg.num_mm_blocks
        if n is None:
            enough = cfg.max_num_seqs * blocks_for(self.max_model_len, cfg.mm_block_rows)
            n = max(1, min(cfg.mm_cache_bytes // per_block, enough))
        return MMCache(num_blocks=n, rows_per_block=cfg.mm_block_rows, hidden_size=spec.hidden_size,
                       dtype=cfg.torch_dtype, device=cfg.device, shuffle_seed=cfg.shuffle_seed)

    def _budgets(self) -> tuple[int, int]:
        cfg = self.config
        tokens, images = cfg.token_budget, cfg.image_budget
        if (tokens is None or images is None) and (cfg.ttft_slo_s or cfg.tbt_slo_s):
            from triptych.worker.engine.profiler import profile_budgets

            found = profile_budgets(self, ttft_slo_s=cfg.ttft_slo_s, tbt_slo_s=cfg.tbt_slo_s)
            tokens = tokens or found.token_budget
            images = images or found.image_budget
            log.info("budgets from SLO profiling: %s", found)
        return tokens or DEFAULT_TOKEN_BUDGET, images or DEFAULT_IMAGE_BUDGET

    @property
    def token_budget(self) -> int:
        return self.scheduler.config.token_budget

    @property
    def image_budget(self) -> int:
        return self.scheduler.config.image_budget

    # --- requests in ------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Validate `req` (raises `RequestValidationError` subclasses) and queue it.

        KV blocks passed in `req.prefilled` belong to the engine from this call on: they
        are freed when the request ends, or right here if it is refused."""
        try:
            self._validate(req)
            with self._lock:
                if req.request_id in self._known_ids:
                    raise RequestValidationError(f"request id {req.request_id!r} is already in use")
                self._known_ids.add(req.request_id)
        except Exception:
            if req.prefilled is not None:
                self._free_refused_blocks(req.prefilled.block_ids)
            raise
        self._inbox.append(("add", req))
        self._wakeup.set()

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; every block it holds is freed."""
        self._inbox.append(("abort", request_id))
        self._wakeup.set()

    def release(self, request_id: str) -> None:
        """A parked request's hand-off is done (the next instance pulled it): free it."""
        self._inbox.append(("release", request_id))
        self._wakeup.set()

    def _free_refused_blocks(self, block_ids: list[int]) -> None:
        if self.kv is None:
            return
        with self._lock:
            for block in block_ids:
                try:
                    self.kv.free([block])
                except ValueError:
                    pass  # not a block this engine handed out

    def _validate(self, req: Request) -> None:
        if not req.stages:
            raise RequestValidationError("request names no stage to run")
        missing = sorted(s.value for s in req.stages if not self.role.runs(s))
        if missing:
            raise StageNotServedError(f"this {self.role.value} instance does not run stage(s) {', '.join(missing)}")
        if req.request_id in self._known_ids:
            raise RequestValidationError(f"request id {req.request_id!r} is already in use")
        n = req.num_prompt_tokens
        if n < 1:
            raise RequestValidationError("prompt has no tokens")
        if self.language is not None and n >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {n} tokens; the model context is {self.max_model_len} tokens "
                "(prompt plus at least one generated token must fit)")
        bad = [t for t in req.prompt_token_ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise RequestValidationError(f"token id {bad[0]} is outside the vocabulary (0..{self.spec.vocab_size - 1})")
        self._validate_mm(req)
        if self.kv is not None and req.stop_after != Stage.ENCODE:
            total = min(n + req.params.max_tokens, self.max_model_len)
            if self.kv.blocks_for(total) > self.kv.num_blocks:
                raise PromptTooLongError(
                    f"request needs up to {total} tokens of KV cache ({self.kv.blocks_for(total)} blocks); "
                    f"this instance holds {self.kv.num_blocks} blocks of {self.kv.block_size}")
        if req.prefilled is not None:
            self._validate_prefilled(req)
        req.seed = resolve_seed(req.params)
        if self.language is not None:
            from triptych.worker.models.rope import prompt_positions

            try:
                req.positions, req.rope_delta = prompt_positions(self.spec, req.prompt_token_ids, req.mm_items)
            except ValueError as exc:
                raise RequestValidationError(str(exc)) from exc
        if req.params.stop and self.tokenizer is None:
            raise RequestValidationError("stop strings need a tokenizer; the checkpoint has no tokenizer.json")
        if self.tokenizer is not None and (self.config.detokenize or req.params.stop):
            req.detok = processor.IncrementalDetokenizer(self.tokenizer)

    def _validate_mm(self, req: Request) -> None:
        placeholder = {self.spec.image_token_id, self.spec.video_token_id}
        for item in req.mm_items:
            span = req.prompt_token_ids[item.offset:item.offset + item.length]
            if item.offset < 0 or len(span) != item.length or any(t not in placeholder for t in span):
                raise RequestValidationError(
                    f"multimodal item at offset {item.offset} (length {item.length}) does not match a run "
                    "of placeholder tokens in the prompt")
        if not req.mm_items:
            return
        encodes_here = Stage.ENCODE in req.stages
        if not encodes_here:
            req.images = {}
        if self.mm is None and req.stop_after != Stage.DECODE:
            raise StageNotServedError(f"this {self.role.value} instance holds no MM cache")
        with self._lock:
            cached = {h for h in {it.content_hash for it in req.mm_items}
                      if self.mm is not None and self.mm.get(h) is not None}
        for item in req.mm_items:
            h = item.content_hash
            if h in req.vision_inputs:
                continue
            if h not in req.images:
                if h in cached or req.prefilled is not None:
                    continue
                where = "given to encode" if encodes_here else "in this instance's MM cache (pull it first)"
                raise MissingEmbeddingError(f"image {h[:16]} at offset {item.offset} is not {where}")
            image = decode_image(req.images[h], self.config.max_image_pixels)
            assert self.vision is not None
            vin = self.vision.preprocess(image)
            if vin.num_tokens != item.length:
                raise RequestValidationError(
                    f"image {h[:16]} ({image.width}x{image.height}) gives {vin.num_tokens} visual tokens "
                    f"but its placeholder run has {item.length}")
            req.vision_inputs[h] = vin

    def _validate_prefilled(self, req: Request) -> None:
        pre = req.prefilled
        assert pre is not None and self.kv is not None
        if Stage.PREFILL in req.stages:
            raise RequestValidationError("a request with a prefilled KV cache must not run the prefill stage")
        if pre.num_tokens != req.num_prompt_tokens:
            raise RequestValidationError(f"prefilled KV holds {pre.num_tokens} tokens; the prompt has "
                                      f"{req.num_prompt_tokens}")
        if len(pre.block_ids) != self.kv.blocks_for(pre.num_tokens):
            raise RequestValidationError(f"{len(pre.block_ids)} KV blocks given for {pre.num_tokens} tokens; "
                                      f"expected {self.kv.blocks_for(pre.num_tokens)}")
        if not 0 <= pre.first_token < self.spec.vocab_size:
            raise RequestValidationError(f"first token {pre.first_token} is outside the vocabulary")

    # --- blocks for pulled data (serving / transfer) ---------------------------------
    def reserve_kv(self, num_tokens: int) -> list[int]:
        """KV blocks for a prefilled KV cache to be written from elsewhere (then pass them in
        `Request.prefilled`; `free_kv` if the pull fails)."""
        if self.kv is None:
            raise StageNotServedError(f"this {self.role.value} instance holds no KV cache")
        with self._lock:
            return self.kv.allocate(self.kv.blocks_for(num_tokens))

    def free_kv(self, block_ids: list[int]) -> None:
        assert self.kv is not None
        with self._lock:
            self.kv.free(block_ids)

    def acquire_mm(self, content_hash: str) -> MMEntry | None:
        """A reference to a cached embedding (None if absent); `release_mm` it when done."""
        if self.mm is None:
            return None
        with self._lock:
            return self.mm.acquire(content_hash)

    def reserve_mm(self, content_hash: str, num_rows: int) -> MMEntry:
        """MM blocks for an embedding to be written from elsewhere; `commit_mm` when written,
        then `release_mm` (requests that use it hold their own references)."""
        if self.mm is None:
            raise StageNotServedError(f"this {self.role.value} instance holds no MM cache")
        with self._lock:
            return self.mm.allocate(content_hash, num_rows)

    def commit_mm(self, entry: MMEntry) -> None:
        with self._lock:
            assert self.mm is not None
            self.mm.commit(entry)
        self._wakeup.set()

    def release_mm(self, entry: MMEntry) -> None:
        with self._lock:
            assert self.mm is not None
            self.mm.release(entry)

    # --- the step ---------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_work

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        with self._lock:
            self._drain_inbox(outputs)
            batch = self.scheduler.schedule()
            for req, why in batch.failed:
                outputs.append(self._finish(req, FinishReason.ERROR, why))
            self._break_kv_deadlock(batch, outputs)
        if batch.is_empty:
            self._park_encoded(outputs)
            return outputs
        self.scheduler.counters.steps += 1
        if batch.encodes:
            self._guarded(self._run_encodes, batch.encodes, [r for r, _ in batch.encodes], outputs)
        sampled: dict[int, tuple[int, dict | None]] = {}
        batch.chunks = [c for c in batch.chunks if not c.req.is_finished]
        if batch.chunks:
            sampled = self._guarded(self._run_language, batch.chunks, [c.req for c in batch.chunks], outputs)
        with self._lock:
            outputs.extend(self._postprocess(batch, sampled))
            self._park_encoded(outputs)
        return outputs

    def _guarded(self, fn: Any, work: Any, reqs: list[Request], outputs: list[RequestOutput]) -> Any:
        """Run a model call; if it raises, fail the requests involved, not the engine."""
        try:
            return fn(work) or {}
        except Exception as exc:  # one bad batch must not stop serving
            log.exception("model step failed")
            with self._lock:
                outputs.extend(self._finish(r, FinishReason.ERROR, f"{type(exc).__name__}: {exc}")
                               for r in dict.fromkeys(reqs) if not r.is_finished)
            return {}

    def _drain_inbox(self, outputs: list[RequestOutput]) -> None:
        while self._inbox:
            kind, arg = self._inbox.popleft()
            if kind == "add":
                self._requests[arg.request_id] = arg
                if arg.prefilled is not None:
                    self._enter_decode(arg)
                self.scheduler.add(arg)
            elif kind in ("abort", "release"):
                req = self._requests.get(arg)
                if req is not None:
                    reason = FinishReason.ABORT if kind == "abort" or req.status != RequestStatus.PARKED else None
                    outputs.append(self._finish(req, reason))

    def _enter_decode(self, req: Request) -> None:
        pre = req.prefilled
        assert pre is not None
        req.block_ids = list(pre.block_ids)
        req.num_computed_tokens = pre.num_tokens
        req.output_token_ids = [pre.first_token]
        req.prefill_done = True
        # Embeddings this engine never had: a recompute could not rebuild the prompt.
        req.recomputable = not req.mm_items
        if req.detok is not None:
            req.text += req.detok.add(pre.first_token)

    def _break_kv_deadlock(self, batch: ScheduledBatch, outputs: list[RequestOutput]) -> None:
        # Requests that cannot be recomputed wait for blocks; if nothing at all runs, no
        # block will ever be freed: fail the latest of them instead of spinning.
        if batch.is_empty and batch.blocked_on_kv and not self._inbox:
            victim = max(batch.blocked_on_kv, key=lambda r: r.arrival_seq)
            outputs.append(self._finish(victim, FinishReason.ERROR, "KV cache exhausted"))

    # --- encode -----------------------------------------------------------------------
    def _run_encodes(self, encodes: list[tuple[Request, int]]) -> None:
        assert self.vision is not None and self.mm is not None
        start = time.monotonic()
        for req, _ in encodes:
            req.timings.encode_start = req.timings.encode_start or start
        items = [req.mm_items[i] for req, i in encodes]
        entries = [req.mm_entries[i] for req, i in encodes]
        embeds = self.vision.encode([req.vision_inputs[it.content_hash] for (req, _), it in zip(encodes, items,
                                                                                                strict=True)])
        with self._lock:
            for entry, emb in zip(entries, embeds, strict=True):
                assert entry is not None
                self.mm.write(entry, emb)
                self.mm.commit(entry)
        end = time.monotonic()
        for req, _ in encodes:
            req.timings.encode_end = end
        self.scheduler.counters.images_encoded += len(encodes)

    def _park_encoded(self, outputs: list[RequestOutput]) -> None:
        """Encode-only requests whose embeddings are all ready hand off (HydraInfer §4.3)."""
        for req in [r for r in self.scheduler.running if r.stop_after == Stage.ENCODE]:
            if all(e is not None and e.ready for e in req.mm_entries):
                seen: dict[str, MMEntry] = {e.content_hash: e for e in req.mm_entries if e is not None}
                handoff = Handoff(Stage.ENCODE, mm=[(h, list(e.block_ids), e.num_rows) for h, e in seen.items()])
                self.scheduler.park(req)
                req.handoff = handoff
                req.timings.encode_end = req.timings.encode_end or time.monotonic()
                outputs.append(self._output(req, [], finished=True, handoff=handoff))

    # --- language model ----------------------------------------------------------------
    def _run_language(self, chunks: list[Chunk]) -> dict[int, tuple[int, dict | None]]:
        assert self.language is not None and self.kv is not None
        ids: list[int] = []
        for c in chunks:
            if c.num_tokens == 1:
                ids.append(c.req.token_at(c.start))
            else:
                ids.extend(c.req.all_token_ids[c.start:c.end])
        token_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        embeds = self.language.embed(token_ids)
        self._scatter_embeddings(embeds, chunks)
        positions = self._positions(chunks).to(self.device)
        meta = build_metadata([c.num_tokens for c in chunks], [c.end for c in chunks],
                              [c.req.block_ids for c in chunks], self.kv.block_size, self.device)
        hidden = self.language(embeds, positions, self.kv.tensor, meta)
        rows, last = [], 0
        sampling_chunks = []
        for c in chunks:
            last += c.num_tokens
            if c.samples:
                rows.append(last - 1)
                sampling_chunks.append(c)
        if not rows:
            return {}
        logits = self.language.logits(hidden[torch.tensor(rows, device=hidden.device)])
        result = sample(logits, [SampleRow(c.req.params, c.req.seed, len(c.req.output_token_ids))
                                 for c in sampling_chunks])
        return {id(c.req): (tok, lp) for c, tok, lp in zip(sampling_chunks, result.token_ids, result.logprobs,
                                                            strict=True)}

    def _scatter_embeddings(self, embeds: torch.Tensor, chunks: list[Chunk]) -> None:
        """Put image embeddings from the MM cache on their placeholder rows, including the
        part of an image span a chunk boundary cuts."""
        if self.mm is None:
            return
        base = 0
        for c in chunks:
            for item, entry in zip(c.req.mm_items, c.req.mm_entries, strict=True):
                lo, hi = max(c.start, item.offset), min(c.end, item.offset + item.length)
                if lo < hi:
                    assert entry is not None and entry.ready, "scheduled a chunk over an unencoded image"
                    rows = self.mm.read(entry, lo - item.offset, hi - item.offset)
                    embeds[base + lo - c.start: base + hi - c.start] = rows.to(embeds.dtype)
            base += c.num_tokens

    def _positions(self, chunks: list[Chunk]) -> torch.Tensor:
        mrope = self.spec.uses_mrope
        parts: list[torch.Tensor] = []
        decode_pos: list[int] = []
        for c in chunks:
            req = c.req
            n = req.num_prompt_tokens
            if c.start >= n:  # generated tokens: index + delta on every axis
                if c.num_tokens == 1:
                    decode_pos.append(c.start + req.rope_delta)
                    continue
                parts.append(self._flush_decodes(decode_pos, mrope))
                decode_pos = []
                parts.append(_arange_pos(c.start, c.end, req.rope_delta, mrope))
                continue
            parts.append(self._flush_decodes(decode_pos, mrope))
            decode_pos = []
            assert req.positions is not None
            parts.append(req.positions[..., c.start:min(c.end, n)])
            if c.end > n:
                parts.append(_arange_pos(n, c.end, req.rope_delta, mrope))
        parts.append(self._flush_decodes(decode_pos, mrope))
        return torch.cat([p for p in parts if p.shape[-1]], dim=-1)

    @staticmethod
    def _flush_decodes(pos: list[int], mrope: bool) -> torch.Tensor:
        t = torch.tensor(pos, dtype=torch.long)
        return t.expand(3, -1) if mrope else t

    # --- after the forward ------------------------------------------------------------
    def _postprocess(self, batch: ScheduledBatch, sampled: dict[int, tuple[int, dict | None]]) -> list[RequestOutput]:
        outputs = []
        now = time.monotonic()
        counters = self.scheduler.counters
        num_decodes = 0
        for req, _ in batch.encodes:
            update_status(req, running=True)
        for c in batch.chunks:
            req = c.req
            if req.is_finished:
                continue
            if req.prefill_done:
                num_decodes += 1
            else:
                counters.prefill_chunks += 1
                counters.prefill_tokens += c.num_tokens
            req.num_computed_tokens = c.end
            self.scheduler.release_passed_mm(req)
            got = sampled.get(id(req))
            if got is None:
                update_status(req, running=True)
                continue
            if not req.prefill_done:
                req.prefill_done = True
                req.timings.prefill_end = now
                req.status = RequestStatus.DECODING
            out = self._append_token(req, got[0], got[1], now)
            if out is not None:
                outputs.append(out)
        if num_decodes:
            counters.decode_steps += 1
            counters.decode_tokens += num_decodes
        return outputs

    def _append_token(self, req: Request, token: int, logprob: dict | None, now: float) -> RequestOutput | None:
        req.output_token_ids.append(token)
        if logprob is not None:
            req.logprobs.append(logprob)
        req.timings.token_times.append(now)
        if req.timings.first_token is None:
            req.timings.first_token = now
        params = req.params
        reason: FinishReason | None = None
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_ids):
            reason = FinishReason.STOP
        elif len(req.output_token_ids) >= params.max_tokens or req.num_tokens >= self.max_model_len:
            reason = FinishReason.LENGTH
        if req.detok is not None:
            delta = req.detok.add(token)
            if reason is not None:
                delta += req.detok.flush()
            req.text += delta
            if params.stop and reason != FinishReason.STOP:
                cut = find_stop(req.text, params.stop, len(req.text) - len(delta))
                if cut >= 0:
                    req.text = req.text[:cut]
                    reason = FinishReason.STOP
        if reason is not None:
            return self._finish(req, reason)
        if Stage.DECODE not in req.stages:
            # Prefill-only: hand the KV blocks (and token 1) to a D instance; keep them until release.
            handoff = Handoff(Stage.PREFILL, kv_block_ids=list(req.block_ids),
                              num_kv_tokens=req.num_computed_tokens, first_token=token)
            self.scheduler.park(req)
            req.handoff = handoff
            return self._output(req, finished=True, handoff=handoff)
        return self._output(req)

    def _finish(self, req: Request, reason: FinishReason | None, error: str | None = None) -> RequestOutput:
        self.scheduler.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.error = error
        req.timings.finished = time.monotonic()
        self._requests.pop(req.request_id, None)
        self._known_ids.discard(req.request_id)
        return self._output(req, finished=True)

    def _output(self, req: Request, new_ids: list[int] | None = None, *, finished: bool = False,
                handoff: Handoff | None = None) -> RequestOutput:
        if new_ids is None:
            new_ids = req.output_token_ids[req.sent_token_len:]
        req.sent_token_len = len(req.output_token_ids)
        text = req.text
        if not finished and req.params.stop:
            # Hold back a tail that could still become a stop string.
            text = text[:max(req.sent_text_len, len(text) - max(len(s) for s in req.params.stop) + 1)]
        new_text, req.sent_text_len = text[req.sent_text_len:], len(text)
        lps = req.logprobs[req.sent_logprobs_len:] if req.params.logprobs else None
        req.sent_logprobs_len = len(req.logprobs)
        return RequestOutput(
            request_id=req.request_id, new_token_ids=list(new_ids), new_text=new_text, finished=finished,
            finish_reason=req.finish_reason, error=req.error, handoff=handoff, logprobs=lps,
            num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=len(req.output_token_ids),
            timings=req.timings.as_dict() if finished else None)

    # --- profiling hooks (profiler.py) -------------------------------------------------
    @torch.inference_mode()
    def measure_prefill(self, num_tokens: int, repeats: int = 3) -> float:
        """Median seconds of one forward over a synthetic prefill chunk of `num_tokens`."""
        assert self.language is not None and self.kv is not None
        with self._lock:
            blocks = self.kv.allocate(self.kv.blocks_for(num_tokens))
        try:
            ids = torch.randint(0, self.spec.vocab_size, (num_tokens,), device=self.device)
            pos = _arange_pos(0, num_tokens, 0, self.spec.uses_mrope).to(self.device)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                meta = build_metadata([num_tokens], [num_tokens], [blocks], self.kv.block_size, self.device)
                hidden = self.language(self.language.embed(ids), pos, self.kv.tensor, meta)
                self.language.logits(hidden[-1:])
                _sync(self.device)
                times.append(time.perf_counter() - t0)
        finally:
            with self._lock:
                self.kv.free(blocks)
        return sorted(times)[len(times) // 2]

    @torch.inference_mode()
    def measure_encode(self, num_images: int, image_size: tuple[int, int] = (448, 448), repeats: int = 3) -> float:
        """Median seconds to encode `num_images` synthetic images of `image_size`."""
        assert self.vision is not None
        from PIL import Image

        vin = self.vision.preprocess(Image.new("RGB", image_size, (120, 80, 200)))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            self.vision.encode([vin] * num_images)
            _sync(self.device)
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    # --- introspection ----------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        with self._lock:
            sched = self.scheduler
            out: dict[str, Any] = {
                "role": self.role.value,
                "token_budget": self.token_budget,
                "image_budget": self.image_budget,
                "num_waiting": len(sched.waiting) + sum(1 for k, _ in self._inbox if k == "add"),
                "num_running": len(sched.running),
                "num_parked": len(sched.parked),
                "counters": sched.counters.as_dict(),
            }
            if self.kv is not None:
                out["kv_cache"] = {"num_blocks": self.kv.num_blocks, "used": self.kv.num_used,
                                   "free": self.kv.num_free, "block_size": self.kv.block_size,
                                   "bytes": self.kv.nbytes}
            if self.mm is not None:
                out["mm_cache"] = {"num_blocks": self.mm.num_blocks, "used": self.mm.num_used,
                                   "free": self.mm.num_free, "referenced": self.mm.num_referenced,
                                   "rows_per_block": self.mm.rows_per_block,
                                   "entries": self.mm.num_entries, "bytes": self.mm.nbytes}
            return out

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    # --- synchronous batch API (tests, CLI, bench) -------------------------------------
    def generate_batch(self, requests: Iterable[Request], timeout_s: float = 600.0) -> list[Request]:
        """Run requests to completion on the calling thread; returns them, finished."""
        if self._thread is not None:
            raise RuntimeError("generate_batch runs the engine on the caller's thread; the background loop is on")
        reqs = list(requests)
        for req in reqs:
            self.add_request(req)
        deadline = time.monotonic() + timeout_s
        while any(r.status not in (RequestStatus.FINISHED, RequestStatus.PARKED) for r in reqs):
            if time.monotonic() > deadline:
                for r in reqs:
                    self.abort(r.request_id)
                self.step()
                raise TimeoutError(f"generate_batch did not finish in {timeout_s} s")
            self.step()
        return reqs

    # --- asyncio driver -----------------------------------------------------------------
    def start(self) -> None:
        """Run steps on a background thread whenever there is work."""
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="triptych-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._thread is None:
            return
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout_s)
        self._thread = None

    def _loop(self) -> None:
        while not self._stopping:
            if not self.has_work:
                self._wakeup.wait(timeout=0.05)
                self._wakeup.clear()
                continue
            try:
                outputs = self.step()
            except Exception as exc:  # a bug outside the model calls: fail everything, keep serving
                log.exception("engine step failed")
                outputs = self._fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
            for out in outputs:
                sink = self._sinks.get(out.request_id)
                if sink is not None:
                    sink(out)
            if not any(out.new_token_ids or out.finished for out in outputs) and self.scheduler.has_work:
                time.sleep(0.001)  # waiting on something external (a pull); don't spin hot

    def _fail_all(self, why: str) -> list[RequestOutput]:
        with self._lock:
            self._drain_inbox([])
            return [self._finish(r, FinishReason.ERROR, why) for r in list(self._requests.values())]

    async def generate(self, req: Request, timeout_s: float | None = 600.0) -> AsyncIterator[RequestOutput]:
        """Stream a request's output deltas; the last one has `finished=True`. Leaving the
        iteration early (client gone) aborts the request. Raises `RequestValidationError` at
        once for bad input, TimeoutError when the request runs past `timeout_s`."""
        if self._thread is None:
            self.start()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        if self._sinks.setdefault(req.request_id, queue) is not queue:
            raise RequestValidationError(f"request id {req.request_id!r} is already in use")
        self._sinks[req.request_id] = lambda out: loop.call_soon_threadsafe(queue.put_nowait, out)
        done = added = False
        try:
            self.add_request(req)
            added = True
            deadline = None if timeout_s is None else loop.time() + timeout_s
            while not done:
                remaining = None if deadline is None else max(0.0, deadline - loop.time())
                out = await asyncio.wait_for(queue.get(), remaining)
                done = out.finished
                yield out
        finally:
            self._sinks.pop(req.request_id, None)
            if added and not done:
                self.abort(req.request_id)


def find_stop(text: str, stops: list[str], search_from: int) -> int:
    """Index of the earliest stop string ending at or after `search_from`, else -1."""
    best = -1
    for stop in stops:
        i = text.find(stop, max(0, search_from - len(stop) + 1))
        if i != -1 and (best == -1 or i < best):
            best = i
    return best


def _arange_pos(start: int, end: int, delta: int, mrope: bool) -> torch.Tensor:
    pos = torch.arange(start + delta, end + delta, dtype=torch.long)
    return pos.expand(3, -1) if mrope else pos


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _load_tokenizer(model_dir: Path) -> Any:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def make_request(request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                 **kwargs: Any) -> Request:
    return Request(request_id, prompt_token_ids, params or SamplingParams(temperature=0.0), **kwargs)


__all__ = ["Engine", "EngineConfig", "OutOfBlocksError", "make_request"]
