"""Request admission: everything `Engine.add_request` checks, in the caller's thread.

A request that passes is ready for the loop: images decoded and preprocessed for the
vision tower (inputs.py), videos decoded and patchified (video_inputs.py), positions
computed (RoPE or M-RoPE), its seed resolved, its stop-string matcher and detokenizer set up. A request that fails raises a typed
`RequestValidationError` and never reaches the loop.
"""

from __future__ import annotations

import threading
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from triptych import processor
from triptych.stop_strings import StopMatcher
from triptych.topology import Stage
from triptych.worker.engine.config import EngineConfig
from triptych.worker.engine.guided import GuideTokenizer
from triptych.worker.engine.inputs import decode_image
from triptych.worker.engine.kv_cache import KVCache
from triptych.worker.engine.mm_cache import MMCache
from triptych.worker.engine.request import (
    MissingEmbeddingError,
    PromptTooLongError,
    Request,
    RequestValidationError,
    StageNotServedError,
)
from triptych.worker.engine.sampling import resolve_seed
from triptych.worker.engine.video_inputs import VideoInputs

if TYPE_CHECKING:
    from triptych.worker.models.loader import LoadedModel


class Admission:
    """Validates requests against one engine's role, model and caches."""

    def __init__(self, config: EngineConfig, model: LoadedModel, kv: KVCache | None, mm: MMCache | None,
                 max_model_len: int, tokenizer: Any, lock: threading.RLock, in_use: set[str]) -> None:
        self.config = config
        self.role = config.role
        self.spec = model.spec
        self.vision = model.vision
        self.has_language = model.language is not None
        self.kv = kv
        self.mm = mm
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self._lock = lock  # the engine's: guards the MM cache lookup
        self._in_use = in_use  # the engine's request ids, added and not finished
        self.videos = VideoInputs(config.model, model.vision)
        self.guides = GuideTokenizer(Path(config.model) / "tokenizer.json", self.spec.vocab_size,
                                     self.spec.eos_token_ids)

    def holds_embedding(self, content_hash: str) -> bool:
        """Whether this instance's MM cache holds the item's embedding now (a peek: an
        entry may still be evicted before the request is scheduled)."""
        with self._lock:
            return self.mm is not None and self.mm.get(content_hash) is not None

    def validate(self, req: Request) -> None:
        """Raise a `RequestValidationError` subclass, or prepare `req` for the loop."""
        if req.prepared_by is not self:
            self.prepare(req)
        elif req.request_id in self._in_use:
            raise RequestValidationError(f"request id {req.request_id!r} is already in use")
        if req.prefilled is not None:
            self._validate_prefilled_blocks(req)

    def prepare(self, req: Request) -> None:
        """Everything `validate` checks and sets up that does not need the prefilled KV's
        block ids: stages, tokens, images, capacity, seed, grammar, positions, text. A
        decode's stage run calls it while its KV pull (a NIXL READ in a transfer thread) is
        in flight, so that `add_request` finds the request ready once the blocks land."""
        if not req.stages:
            raise RequestValidationError("request names no stage to run")
        missing = sorted(s.value for s in req.stages if not self.role.runs(s))
        if missing:
            raise StageNotServedError(f"this {self.role.value} instance does not run stage(s) {', '.join(missing)}")
        if req.request_id in self._in_use:
            raise RequestValidationError(f"request id {req.request_id!r} is already in use")
        self._validate_tokens(req)
        self._validate_mm(req)
        self._validate_kv_capacity(req)
        if req.prefilled is not None:
            self._validate_prefilled(req)
        req.seed = resolve_seed(req.params)
        self._prepare_guide(req)
        if self.has_language:
            from triptych.worker.models.rope import prompt_positions

            try:
                req.positions, req.rope_delta = prompt_positions(self.spec, req.prompt_token_ids, req.mm_items)
            except ValueError as exc:
                raise RequestValidationError(str(exc)) from exc
        self._prepare_text(req)
        req.prepared_by = self

    def _validate_tokens(self, req: Request) -> None:
        n = req.num_prompt_tokens
        if n < 1:
            raise RequestValidationError("prompt has no tokens")
        if self.has_language and n >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {n} tokens; the model context is {self.max_model_len} tokens "
                "(prompt plus at least one generated token must fit)")
        bad = [t for t in req.prompt_token_ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise RequestValidationError(f"token id {bad[0]} is outside the vocabulary (0..{self.spec.vocab_size - 1})")
        bad = [t for t in req.params.logit_bias if t >= self.spec.vocab_size]
        if bad:
            raise RequestValidationError(f"logit_bias: token id {bad[0]} is outside the vocabulary "
                                         f"(0..{self.spec.vocab_size - 1})")

    def _validate_kv_capacity(self, req: Request) -> None:
        if self.kv is None or req.stop_after == Stage.ENCODE:
            return
        total = min(req.num_prompt_tokens + req.params.max_tokens, self.max_model_len)
        if self.kv.blocks_for(total) > self.kv.num_blocks:
            raise PromptTooLongError(
                f"request needs up to {total} tokens of KV cache ({self.kv.blocks_for(total)} blocks); "
                f"this instance holds {self.kv.num_blocks} blocks of {self.kv.block_size}")

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
        self._prepare_frames(req, cached)
        for item in req.mm_items:
            h = item.content_hash
            if h in req.vision_inputs:
                continue
            if item.kind == "video" and h in cached:
                continue  # its embedding is here: the video is not decoded again
            if h not in req.images:
                if h in cached or req.prefilled is not None:
                    continue
                where = "given to encode" if encodes_here else "in this instance's MM cache (pull it first)"
                raise MissingEmbeddingError(f"{item.kind} {h[:16]} at offset {item.offset} is not {where}")
            assert self.vision is not None
            if item.kind == "video":
                req.vision_inputs[h] = self.videos.prepare(req.images[h], item)
                continue
            image = decode_image(req.images[h], self.config.max_image_pixels)
            vin = self.vision.preprocess(image)
            if vin.num_tokens != item.length:
                raise RequestValidationError(
                    f"image {h[:16]} ({image.width}x{image.height}) gives {vin.num_tokens} visual tokens "
                    f"but its placeholder run has {item.length}")
            req.vision_inputs[h] = vin

    def _prepare_frames(self, req: Request, cached: set[str]) -> None:
        """Videos taken as images (LLaVA) given as bytes under the video's key: each decoded
        once, its sampled frames the inputs of its frame items (stage_run does this before
        admission, off the event loop; this serves direct callers of `add_request`)."""
        groups: dict[str, list[Any]] = {}
        for item in req.mm_items:
            frame = getattr(item, "frame", None)
            if frame is not None and item.content_hash not in req.vision_inputs and item.content_hash not in cached:
                groups.setdefault(frame.video, []).append(item)
        for key, items in groups.items():
            if key in req.images:
                req.vision_inputs.update(self.videos.prepare_frames(req.images[key], items))

    def _validate_prefilled(self, req: Request) -> None:
        pre = req.prefilled
        assert pre is not None and self.kv is not None
        if Stage.PREFILL in req.stages:
            raise RequestValidationError("a request with a prefilled KV cache must not run the prefill stage")
        if pre.num_tokens != req.num_prompt_tokens + len(pre.generated):
            raise RequestValidationError(f"prefilled KV holds {pre.num_tokens} tokens; the prompt and the "
                                         f"tokens generated before have {req.num_prompt_tokens + len(pre.generated)}")
        if not all(0 <= t < self.spec.vocab_size for t in [*pre.generated, pre.first_token]):
            raise RequestValidationError(f"a generated token of {[*pre.generated, pre.first_token]} is "
                                         "outside the vocabulary")
        if pre.generated and len(pre.generated) + 1 >= req.params.max_tokens:
            raise RequestValidationError(f"{len(pre.generated) + 1} tokens were generated already; "
                                         f"max_tokens is {req.params.max_tokens}")

    def _validate_prefilled_blocks(self, req: Request) -> None:
        pre = req.prefilled
        assert pre is not None and self.kv is not None
        if len(pre.block_ids) != self.kv.blocks_for(pre.num_tokens):
            raise RequestValidationError(f"{len(pre.block_ids)} KV blocks given for {pre.num_tokens} tokens; "
                                         f"expected {self.kv.blocks_for(pre.num_tokens)}")

    def _prepare_guide(self, req: Request) -> None:
        """The request's grammar matcher, on every instance that samples for it; a decode
        that takes over replays the tokens sampled before it (guided.py)."""
        if req.grammar is None or req.guide is not None or not self.has_language or req.stop_after == Stage.ENCODE:
            return  # no grammar, or the serving layer built the matcher already (off the event loop)
        pre = req.prefilled
        replay = [*pre.generated, pre.first_token] if pre is not None else []
        req.guide = self.guides.matcher(req.grammar, replay)

    def _prepare_text(self, req: Request) -> None:
        """Detokenize as tokens come only where it is needed: for stop strings, or when
        configured to stream text. Otherwise `Request.text` decodes once, when read."""
        if req.params.stop and self.tokenizer is None:
            raise RequestValidationError("stop strings need a tokenizer; the checkpoint has no tokenizer.json")
        if self.tokenizer is None:
            return
        if req.params.stop or self.config.detokenize:
            req.detok = processor.IncrementalDetokenizer(self.tokenizer)
            req.stop_matcher = StopMatcher(req.params.stop) if req.params.stop else None
        else:
            req.decode_text = partial(self.tokenizer.decode, skip_special_tokens=True)
