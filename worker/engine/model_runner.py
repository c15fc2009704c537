"""The model runner: one scheduled batch through the model (the seam of nano-vllm's and
vLLM v1's ModelRunner).

Encodes go through the vision tower into the MM cache. Every prefill chunk and decode of
the batch runs in ONE language-model forward over the paged KV cache: the chunks' tokens
are concatenated, embedded, image embeddings from the MM cache are scattered onto their
placeholder rows, positions are built per chunk (RoPE `[T]` or M-RoPE `[3, T]`), and the
last row of each chunk that ends its sequence is sampled. The runner touches no queue: it
reads requests and writes only the caches, request timings and the encode counter.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from triptych.worker.attention import build_metadata
from triptych.worker.engine.batch import Chunk
from triptych.worker.engine.guided import mask_logits
from triptych.worker.engine.kv_cache import KVCache
from triptych.worker.engine.mm_cache import MMCache
from triptych.worker.engine.request import Request
from triptych.worker.engine.sampling import SampleRow, choice_seed, sample
from triptych.worker.engine.scheduler import Counters

# What a forward sampled, keyed by id(request): (token, logprob entry or None).
Sampled = dict[int, tuple[int, dict | None]]


class ModelRunner:
    def __init__(self, model: Any, kv: KVCache | None, mm: MMCache | None, device: torch.device,
                 lock: threading.RLock, counters: Counters | None = None) -> None:
        self.spec = model.spec
        self.vision = model.vision
        self.language = model.language
        self.kv = kv
        self.mm = mm
        self.device = device
        self.counters = counters or Counters()
        self._lock = lock  # the engine's: guards cache allocation against reserve_* callers
        self.eos_ids: frozenset[int] = frozenset()  # what min_tokens holds back (the engine sets it)

    # --- encode -------------------------------------------------------------------------
    def run_encodes(self, encodes: list[tuple[Request, int]],
                    before_commit: Callable[[], None] | None = None) -> None:
        """Encode item `i` of each `(request, i)` and commit it to its MM cache entry.
        `before_commit` runs between the writes and the commit: on a side CUDA stream
        (parallel_vision.py) it waits for the writes, so no reader of a committed entry
        sees rows still being written."""
        assert self.vision is not None and self.mm is not None
        start = time.monotonic()
        for req, _ in encodes:
            req.timings.encode_start = req.timings.encode_start or start
        items = [req.mm_items[i] for req, i in encodes]
        entries = [req.mm_entries[i] for req, i in encodes]
        embeds = self.vision.encode([req.vision_inputs[it.content_hash]
                                     for (req, _), it in zip(encodes, items, strict=True)])
        with self._lock:
            for entry, emb in zip(entries, embeds, strict=True):
                assert entry is not None
                self.mm.write(entry, emb)
        if before_commit is not None:
            before_commit()
        with self._lock:
            for entry in entries:
                assert entry is not None
                self.mm.commit(entry)
        end = time.monotonic()
        for req, _ in encodes:
            req.timings.encode_end = end
        self.counters.images_encoded += len(encodes)

    # --- language model -------------------------------------------------------------------
    def run_language(self, chunks: list[Chunk]) -> Sampled:
        """One forward over all chunks; samples the chunks that end their sequence."""
        return self.sample(chunks, self.forward(chunks))

    def forward(self, chunks: list[Chunk]) -> torch.Tensor:
        """Hidden states `[T, H]` of the chunks' tokens (batch order); writes their KV."""
        assert self.language is not None and self.kv is not None
        token_ids = torch.tensor(batch_token_ids(chunks), dtype=torch.long, device=self.device)
        embeds = self.language.embed(token_ids)
        if self.mm is not None:
            scatter_embeddings(embeds, chunks, self.mm)
        positions = chunk_positions(chunks, self.spec.uses_mrope).to(self.device)
        meta = build_metadata([c.num_tokens for c in chunks], [c.end for c in chunks],
                              [c.req.block_ids for c in chunks], self.kv.block_size, self.device)
        return self.language(embeds, positions, self.kv.tensor, meta)

    def sample(self, chunks: list[Chunk], hidden: torch.Tensor) -> Sampled:
        """A token for each chunk that ends its sequence, from its last row of `hidden`."""
        assert self.language is not None
        rows, sampling = sample_rows(chunks)
        if not rows:
            return {}
        srows = [self.sample_row(c.req) for c in sampling]
        # An n > 1 request's first token: choices 1..n-1 sample theirs from the same logits
        # with their own seeds (one prefill, n first tokens; worker/choices.py forks the KV).
        forks: list[tuple[Request, int]] = []
        for row, c in zip(list(rows), sampling, strict=True):
            if c.req.params.n > 1 and not c.req.output_token_ids:
                for i in range(1, c.req.params.n):
                    rows.append(row)
                    srows.append(replace(self.sample_row(c.req), seed=choice_seed(c.req.seed, i)))
                    forks.append((c.req, i))
        logits = self.language.logits(hidden[torch.tensor(rows, device=hidden.device)])
        # Grammars (structured output, forced tool calls) mask before any sampling rule. An
        # n > 1 request's extra first-token rows share its guide: no choice has advanced it yet.
        guides = [c.req.guide for c in sampling] + [req.guide for req, _ in forks]
        logits = mask_logits(logits, guides)
        result = sample(logits, srows)
        k = len(sampling)
        for (req, _), tok, lp in zip(forks, result.token_ids[k:], result.logprobs[k:], strict=True):
            req.choice_firsts.append((tok, lp))
        return {id(c.req): (tok, lp) for c, tok, lp in zip(sampling, result.token_ids[:k], result.logprobs[:k],
                                                            strict=True)}

    def sample_row(self, req: Request) -> SampleRow:
        params = req.params
        stop_ids: frozenset[int] = frozenset()
        if len(req.output_token_ids) < params.min_tokens:  # only min_tokens reads them
            stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        return SampleRow(params, req.seed, len(req.output_token_ids), prompt_ids=req.prompt_token_ids,
                         output_ids=req.output_token_ids, stop_ids=stop_ids)

    # --- profiling hooks (profiler.py) -------------------------------------------------
    @torch.inference_mode()
    def measure_prefill(self, num_tokens: int, repeats: int = 3) -> float:
        """Median seconds of one forward over a synthetic prefill chunk of `num_tokens`."""
        assert self.language is not None and self.kv is not None
        with self._lock:
            blocks = self.kv.allocate(self.kv.blocks_for(num_tokens))
        try:
            ids = torch.randint(0, self.spec.vocab_size, (num_tokens,), device=self.device)
            pos = arange_positions(0, num_tokens, 0, self.spec.uses_mrope).to(self.device)
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


# --- batch inputs (pure functions of the chunks) -------------------------------------------

def batch_token_ids(chunks: list[Chunk]) -> list[int]:
    """The chunks' tokens, concatenated in batch order."""
    ids: list[int] = []
    for c in chunks:
        if c.num_tokens == 1:
            ids.append(c.req.token_at(c.start))
        else:
            ids.extend(c.req.all_token_ids[c.start:c.end])
    return ids


def scatter_embeddings(embeds: torch.Tensor, chunks: list[Chunk], mm: MMCache) -> None:
    """Put image embeddings from the MM cache on their placeholder rows of `embeds`
    (`[T, H]`, batch order), including the part of an image span a chunk boundary cuts."""
    base = 0
    for c in chunks:
        for item, entry in zip(c.req.mm_items, c.req.mm_entries, strict=True):
            lo, hi = max(c.start, item.offset), min(c.end, item.offset + item.length)
            if lo < hi:
                assert entry is not None and entry.ready, "scheduled a chunk over an unencoded image"
                rows = mm.read(entry, lo - item.offset, hi - item.offset)
                embeds[base + lo - c.start: base + hi - c.start] = rows.to(embeds.dtype)
        base += c.num_tokens


def chunk_positions(chunks: list[Chunk], mrope: bool) -> torch.Tensor:
    """Positions of the batch's tokens: `[T]` (RoPE) or `[3, T]` (M-RoPE). Prompt tokens
    take the request's precomputed prompt positions; a generated token at index `i` is
    at `i + rope_delta` (on every axis). Runs of decodes become one tensor."""
    parts: list[torch.Tensor] = []
    decode_pos: list[int] = []
    for c in chunks:
        req = c.req
        n = req.num_prompt_tokens
        if c.start >= n and c.num_tokens == 1:
            decode_pos.append(c.start + req.rope_delta)
            continue
        parts.append(_decode_positions(decode_pos, mrope))
        decode_pos = []
        if c.start >= n:  # generated tokens recomputed after preemption
            parts.append(arange_positions(c.start, c.end, req.rope_delta, mrope))
            continue
        assert req.positions is not None
        parts.append(req.positions[..., c.start:min(c.end, n)])
        if c.end > n:
            parts.append(arange_positions(n, c.end, req.rope_delta, mrope))
    parts.append(_decode_positions(decode_pos, mrope))
    return torch.cat([p for p in parts if p.shape[-1]], dim=-1)


def sample_rows(chunks: list[Chunk]) -> tuple[list[int], list[Chunk]]:
    """Row (in batch order) of the last token of each chunk that ends its sequence, and
    those chunks: the rows whose logits are sampled."""
    rows: list[int] = []
    sampling: list[Chunk] = []
    last = 0
    for c in chunks:
        last += c.num_tokens
        if c.samples:
            rows.append(last - 1)
            sampling.append(c)
    return rows, sampling


def arange_positions(start: int, end: int, delta: int, mrope: bool) -> torch.Tensor:
    pos = torch.arange(start + delta, end + delta, dtype=torch.long)
    return pos.expand(3, -1) if mrope else pos


def _decode_positions(pos: list[int], mrope: bool) -> torch.Tensor:
    t = torch.tensor(pos, dtype=torch.long)
    return t.expand(3, -1) if mrope else t


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
