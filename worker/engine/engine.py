"""The inference engine of one instance: the core that ties admission, scheduler, model
runner, output processing and driver together (the split of nano-vllm and vLLM v1).

`Engine.step()` runs one iteration of stage-level batching: the scheduler (scheduler.py)
builds a batch, the model runner (model_runner.py) runs its encodes through the vision
tower into the MM cache and every prefill chunk and decode in ONE language-model forward
over the paged KV cache, sampling the rows that end a sequence, and the output processor
(outputs.py) appends the tokens, checks stops and hand-offs and emits deltas. `step()` is
synchronous and single-threaded; the driver (driver.py: `start()` / `generate()`) runs it
on a background thread while there is work and sleeps otherwise.

Requests enter through `add_request`, which validates them in the caller's thread
(admission.py, typed `RequestValidationError`s) and hands them to the loop through an
inbox; aborts and releases go through the inbox too, so a request's blocks are never freed
while a forward writes them. Serving reserves cache blocks for pulled data with
`reserve_kv` / `reserve_mm`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from triptych.sampling_params import SamplingParams
from triptych.topology import InstanceType, Stage
from triptych.worker.engine.admission import Admission
from triptych.worker.engine.batch import ScheduledBatch
from triptych.worker.engine.config import EngineConfig, make_kv_cache, make_mm_cache
from triptych.worker.engine.driver import EngineDriver
from triptych.worker.engine.kv_cache import OutOfBlocksError
from triptych.worker.engine.model_runner import ModelRunner, Sampled
from triptych.worker.engine.outputs import OutputProcessor
from triptych.worker.engine.parallel_vision import ParallelVision, make_parallel_vision
from triptych.worker.engine.precopy import PreCopy
from triptych.worker.engine.profiler import engine_budgets
from triptych.worker.engine.pulled_blocks import PulledBlocks
from triptych.worker.engine.request import (
    FinishReason,
    Request,
    RequestOutput,
    RequestStatus,
    RequestValidationError,
)
from triptych.worker.engine.role_change import PartsChanged, change_parts, join_parts, needs_mm, same_parts
from triptych.worker.engine.scheduler import Counters, QueuedWork, Scheduler, SchedulerConfig
from triptych.worker.models.linear_kernels import warm

log = logging.getLogger(__name__)


class Engine(PulledBlocks, PreCopy):
    def __init__(self, config: EngineConfig, model: Any = None) -> None:
        from triptych.worker.models.loader import load_model

        self.config = config
        self.role = config.role
        if config.threads:
            torch.set_num_threads(config.threads)
        self.model = model or load_model(
            config.model, vision=self.role.needs_vision, language=self.role.needs_language,
            dtype=config.torch_dtype, device=config.device)
        self.spec, self.vision, self.language = self.model.spec, self.model.vision, self.model.language
        if config.compile_decode and self.language is not None:
            from triptych.worker.models.compile import compile_language_model

            compile_language_model(self.language)
        self.device = torch.device(config.device)
        self.max_model_len = min(config.max_model_len or self.spec.max_model_len, self.spec.max_model_len)
        self.tokenizer = _load_tokenizer(Path(config.model))
        self.kv = make_kv_cache(config, self.spec, self.max_model_len) if self.language is not None else None
        holds_mm = needs_mm(self.role, config.keep_mm_cache)
        self.mm = make_mm_cache(config, self.spec, self.max_model_len) if holds_mm else None
        self._requests: dict[str, Request] = {}  # in the loop, by id
        self._known_ids: set[str] = set()  # added and not finished (inbox included)
        self._inbox: deque[tuple[str, Any]] = deque()
        self._lock = threading.RLock()  # guards caches and queues against reserve_* callers
        self.runner = ModelRunner(self.model, self.kv, self.mm, self.device, self._lock)  # profiling uses it
        self._budget_pair = engine_budgets(self)
        self._wire(Counters(), self.spec.eos_token_ids)
        self.migrating_out = False  # park every decode after its step (role switch / drain)
        self.reset_precopy()
        self.driver = EngineDriver(self)
        self.stalled = False  # the last step found nothing it could run

    def _wire(self, counters: Counters, eos_ids: Iterable[int]) -> None:
        """(Re)build the parts that hold the model and caches (at start, and on set_role)."""
        self.spec, self.vision, self.language = self.model.spec, self.model.vision, self.model.language
        self.admission = Admission(self.config, self.model, self.kv, self.mm, self.max_model_len, self.tokenizer,
                                   self._lock, self._known_ids)
        self.runner = ModelRunner(self.model, self.kv, self.mm, self.device, self._lock)
        # Encodes beside the language forward on a side CUDA stream (parallel_vision.py).
        if getattr(self, "parallel_vision", None) is not None:
            self.parallel_vision.close()  # a role change: the new parts decide again
        self.parallel_vision = make_parallel_vision(self.config.parallel_vision, self.device,
                                                    self.vision is not None, self.language is not None)
        tokens, images = self._budget_pair
        self.scheduler = Scheduler(SchedulerConfig(tokens, images, self.config.max_num_seqs,
                                                   self.config.encode_token_budget), self.kv, self.mm)
        self.scheduler.counters = self.runner.counters = counters
        self.output = OutputProcessor(self.scheduler, self._requests, self._known_ids, eos_ids, self.max_model_len)
        self.runner.eos_ids = self.output.eos_ids

    def set_role(self, role: InstanceType, preloaded: Any = None, *, wait: bool = True) -> PartsChanged | None:
        """Serve `role` from now on, in place (role_change.py): kept weights and caches stay,
        only what the new role adds or drops is loaded or freed. Needs an engine holding
        no request (the instance offloads and migrates first). Without `wait`: None at
        once when a step holds the engine (it does so only around its forward)."""
        if not self._lock.acquire(blocking=wait):
            return None
        try:
            self._run_inbox_now()  # its adds count as held below
            self.precopy_armed = self.precopy_armed and not role.runs(Stage.DECODE)  # decodes that stay: no pre-copy
            # Hand-overs still parked (a migrated decode, a prefill's KV) wait for their pull under a lease:
            # across a change that keeps the language model and its KV cache (P <-> D) they stay put.
            parked = dict(self.scheduler.parked)
            held = len(self._requests.keys() - parked.keys())
            if held or self.scheduler.has_work:
                if not same_parts(self, role):
                    raise RuntimeError(f"set_role needs an idle engine; {len(self._requests)} request(s) held")
                # P <-> D with decodes still running (InstanceRuntime live switch): the engine
                # keeps stepping them; only admission (new work) follows the new role.
                self.role = self.config.role = self.admission.role = role
                return PartsChanged([], [])
            if not role.needs_language:
                # The KV cache goes: its parked hand-overs are detached (their blocks go back to that
                # cache, which nothing allocates from again); their pulls read it through the old transfer
                # agent, kept until its last lease is released (InstanceRuntime._retire).
                for request_id, req in list(parked.items()):
                    if req.handoff is not None and req.handoff.stage != Stage.ENCODE:
                        self.output.finish(req, None)
                        del parked[request_id]
            changed = change_parts(self, role, preloaded)  # preloaded: role_change.preload_parts
            self.role = self.config.role = role
            self.migrating_out = False
            self._wire(self.scheduler.counters, self.output.eos_ids)
            self.scheduler.parked.update(parked)
            return changed
        finally:
            self._lock.release()

    def join_parts(self, role: InstanceType, preloaded: Any = None) -> None:
        """Serve `role` from now on beside the work in flight: what it adds joins the parts
        held, nothing is freed (role_change.join_parts); admission follows `role`."""
        with self._lock:
            self._run_inbox_now()
            self.precopy_armed = self.precopy_armed and not role.runs(Stage.DECODE)
            join_parts(self, role, preloaded)
            self.role = self.config.role = self.admission.role = role

    def _run_inbox_now(self) -> None:
        """Under the lock, before a role change: the inbox runs, and its outputs (a switch's
        hand-backs and pre-copy offers) go out at once, ahead of a step in flight's."""
        drained: list[RequestOutput] = []
        self._drain_inbox(drained)
        self.driver.deliver(drained)

    def offload(self, *, migrate: bool) -> None:
        """Hand back queued work that has not started; with `migrate`, park every decode
        after its next step for another instance to pull (EPDServe §3.2.4)."""
        self._inbox.append(("offload", migrate))
        self.driver.wake()

    def park_decodes(self) -> None:
        """Park every decode at the next step boundary (and each one after it, until
        `migrating_out` is reset) for another instance to pull; queued work stays."""
        self._inbox.append(("park", None))
        self.driver.wake()

    @property
    def token_budget(self) -> int:
        return self.scheduler.config.token_budget

    @property
    def image_budget(self) -> int:
        return self.scheduler.config.image_budget

    @property
    def eos_ids(self) -> frozenset[int]:
        return self.output.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids: Iterable[int]) -> None:
        self.output.eos_ids = self.runner.eos_ids = frozenset(ids)

    # --- requests in ------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Validate `req` (raises `RequestValidationError` subclasses) and queue it.

        KV blocks passed in `req.prefilled` belong to the engine from this call on: they
        are freed when the request ends, or right here if it is refused."""
        try:
            self.admission.validate(req)
            with self._lock:
                if req.request_id in self._known_ids:
                    raise RequestValidationError(f"request id {req.request_id!r} is already in use")
                self._known_ids.add(req.request_id)
        except Exception:
            if req.prefilled is not None:
                self._free_refused_blocks(req.prefilled.block_ids)
            raise
        self._inbox.append(("add", req))
        self.driver.wake()

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; every block it holds is freed."""
        self._inbox.append(("abort", request_id))
        self.driver.wake()

    def release(self, request_id: str) -> None:
        """A parked request's hand-off is done (the next instance pulled it): free it."""
        self._inbox.append(("release", request_id))
        self.driver.wake()

    # --- the step ---------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_work

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule a batch, run it through the model, process the outputs."""
        outputs: list[RequestOutput] = []
        with self._lock:
            self._drain_inbox(outputs)
            if any(o.handoff is not None for o in outputs):
                # Decodes parked at this boundary (switch, drain): their hand-overs go out
                # now, not after one more forward of the rest; the next step follows at once.
                return outputs
            batch = self._schedule(outputs)
        self.stalled = batch.is_empty
        sampled: Sampled = {}
        if not batch.is_empty:
            self.scheduler.counters.steps += 1
            sampled = self._run(batch, outputs)
        with self._lock:
            outputs.extend(self.output.process(batch, sampled))
            self.output.park_encoded(outputs)
            outputs.extend(self._move_out_decodes() if self.migrating_out else self._late_precopies())
        return outputs

    def _schedule(self, outputs: list[RequestOutput]) -> ScheduledBatch:
        outputs.extend(self.output.absorb_feeds())  # tokens a migrated decode's source sampled
        batch = self.scheduler.schedule()
        for req, why in batch.failed:
            outputs.append(self.output.finish(req, FinishReason.ERROR, why))
        # Requests that cannot be recomputed wait for blocks; if nothing at all runs, no
        # block will ever be freed: fail the latest of them instead of spinning.
        if batch.is_empty and batch.blocked_on_kv and not self._inbox:
            victim = max(batch.blocked_on_kv, key=lambda r: r.arrival_seq)
            outputs.append(self.output.finish(victim, FinishReason.ERROR, "KV cache exhausted"))
        return batch

    def _run(self, batch: ScheduledBatch, outputs: list[RequestOutput]) -> Sampled:
        if batch.encodes and batch.chunks and self.parallel_vision is not None:
            return self._run_parallel(batch, outputs, self.parallel_vision)
        if batch.encodes:
            self._guarded(self.runner.run_encodes, batch.encodes, [r for r, _ in batch.encodes], outputs)
        batch.chunks = [c for c in batch.chunks if not c.req.is_finished]
        if not batch.chunks:
            return {}
        return self._guarded(self.runner.run_language, batch.chunks, [c.req for c in batch.chunks], outputs)

    def _run_parallel(self, batch: ScheduledBatch, outputs: list[RequestOutput], pv: ParallelVision) -> Sampled:
        """Encodes on the side stream, language on this one (HydraInfer §4.2). An encode
        failure fails its requests after the forward; a chunk of such a request computed
        this step is dropped (the sequential path would not have run it)."""
        language, encoded = pv.overlap(
            lambda before_commit: self.runner.run_encodes(batch.encodes, before_commit),
            lambda: self.runner.run_language(batch.chunks))
        # Failures are handled once both are done: failing a request frees its blocks.
        self._guarded(lambda _: encoded.result(), None, [r for r, _ in batch.encodes], outputs)
        sampled = self._guarded(lambda _: language.result(), None, [c.req for c in batch.chunks], outputs)
        batch.chunks = [c for c in batch.chunks if not c.req.is_finished]
        kept = {id(c.req) for c in batch.chunks}
        return {k: v for k, v in sampled.items() if k in kept}

    def _guarded(self, fn: Callable[[Any], Any], work: Any, reqs: list[Request],
                 outputs: list[RequestOutput]) -> Any:
        """Run a model call; if it raises, fail the requests involved, not the engine."""
        try:
            return fn(work) or {}
        except Exception as exc:  # one bad batch must not stop serving
            log.exception("model step failed")
            with self._lock:
                outputs.extend(self.output.finish(r, FinishReason.ERROR, f"{type(exc).__name__}: {exc}")
                               for r in dict.fromkeys(reqs) if not r.is_finished)
            return {}

    def _drain_inbox(self, outputs: list[RequestOutput]) -> None:
        while self._inbox:
            kind, arg = self._inbox.popleft()
            if kind == "add":
                self._requests[arg.request_id] = arg
                if arg.prefilled is not None:
                    self.output.enter_decode(arg)
                self.scheduler.add(arg)
            elif kind == "offload":
                outputs.extend(self.output.hand_back())
                self.migrating_out = self.migrating_out or arg
                if arg:
                    outputs.extend(self._move_out_decodes())
            elif kind == "park":  # the decodes of a live switch's old role move out now
                self.migrating_out = True
                outputs.extend(self._move_out_decodes())
            elif kind == "precopy":
                outputs.extend(self._precopy_outputs())
            elif kind in ("abort", "release"):
                req = self._requests.get(arg)
                if req is not None:
                    reason = FinishReason.ABORT if kind == "abort" or req.status != RequestStatus.PARKED else None
                    outputs.append(self.output.finish(req, reason))

    def fail_all(self, why: str) -> list[RequestOutput]:
        """After an unexpected step failure: end every request with an error."""
        with self._lock:
            outputs: list[RequestOutput] = []
            self._drain_inbox(outputs)  # a hand-back in it ends its stream as any other output
            return outputs + [self.output.finish(r, FinishReason.ERROR, why) for r in list(self._requests.values())]

    # --- profiling hooks (profiler.py) -------------------------------------------------
    def measure_prefill(self, num_tokens: int, repeats: int = 3) -> float:
        """Median seconds of one forward over a synthetic prefill chunk of `num_tokens`."""
        return self.runner.measure_prefill(num_tokens, repeats)

    def measure_encode(self, num_images: int, image_size: tuple[int, int] = (448, 448), repeats: int = 3) -> float:
        """Median seconds to encode `num_images` synthetic images of `image_size`."""
        return self.runner.measure_encode(num_images, image_size, repeats)

    # --- introspection ----------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        with self._lock:
            sched = self.scheduler
            out: dict[str, Any] = {
                "role": self.role.value,
                "token_budget": self.token_budget,
                "image_budget": self.image_budget,
                "num_waiting": len(sched.waiting) + sum(1 for k, _ in self._inbox if k == "add"),
                "num_running": len(sched.running), "num_parked": len(sched.parked),
                "max_num_seqs": self.config.max_num_seqs,
                "counters": sched.counters.as_dict(),
            }
            if self.kv is not None:
                out["kv_cache"] = self.kv.stats()
            if self.mm is not None:
                out["mm_cache"] = self.mm.stats()
            return out

    def queued_work(self) -> dict[Stage, QueuedWork]:
        """Per-stage queues of this instance (`Scheduler.queued_work`), for /metrics."""
        with self._lock:
            arriving = [arg for kind, arg in list(self._inbox) if kind == "add"]
            return self.scheduler.queued_work(arriving)

    @property
    def has_pending_inbox(self) -> bool:
        return bool(self._inbox)

    @property
    def num_requests(self) -> int:
        """Requests the engine holds (queued, running, parked) or has yet to take in."""
        return len(self._known_ids | self._requests.keys())

    def request_ids(self, *, parked: bool = True) -> list[str]:
        """Every request held or to come in; without `parked`, those parked for a hand-over left out."""
        with self._lock:
            ids = self._known_ids | self._requests.keys()
            return sorted(ids if parked else ids - self.scheduler.parked.keys())

    def parked_ids(self, stage: Stage | None = None) -> list[str]:
        """Requests parked for a hand-over (a pull by another instance releases them); with
        `stage`, those handing over after it (DECODE: decodes migrated out)."""
        with self._lock:
            return sorted(i for i, r in self.scheduler.parked.items()
                          if stage is None or (r.handoff is not None and r.handoff.stage == stage))

    def get_request(self, request_id: str) -> Request | None:
        """A request held, or added and not yet taken in (its stages say what it runs)."""
        adds = (arg for kind, arg in list(self._inbox) if kind == "add" and arg.request_id == request_id)
        return self._requests.get(request_id) or next(adds, None)

    # --- synchronous batch API (tests, CLI, bench) -------------------------------------
    def generate_batch(self, requests: Iterable[Request], timeout_s: float = 600.0) -> list[Request]:
        """Run requests to completion on the calling thread; returns them, finished."""
        if self.driver.running:
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

    # --- the driver (driver.py) -----------------------------------------------------------
    def start(self) -> None:
        """Run steps on a background thread whenever there is work."""
        self.driver.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self.driver.stop(timeout_s)

    def warm_ups(self) -> Iterator[int]:
        """The language model's GEMM kernels of every decode batch size, built one size per
        `next()` (linear_kernels.warm); the driver runs them while it idles."""
        return warm(self.language.gemm_kernels() if self.language is not None else [], self.config.max_num_seqs)

    def generate(self, req: Request, timeout_s: float | None = 600.0) -> AsyncIterator[RequestOutput]:
        """Stream a request's output deltas; the last one has `finished=True`. Leaving the
        iteration early (client gone) aborts the request. Raises `RequestValidationError` at
        once for bad input, TimeoutError when the request runs past `timeout_s`."""
        return self.driver.generate(req, timeout_s)

    def generate_batches(self, req: Request, timeout_s: float | None = 600.0,
                         direct: Callable[[list[RequestOutput]], bool] | None = None,
                         ) -> AsyncIterator[list[RequestOutput]]:
        """`generate`, with every output already queued for the request taken at once
        (`direct`: see `EngineDriver.generate_batches`)."""
        return self.driver.generate_batches(req, timeout_s, direct)


def _load_tokenizer(model_dir: Path) -> Any:
    from tokenizers import Tokenizer

    path = model_dir / "tokenizer.json"
    return Tokenizer.from_file(str(path)) if path.is_file() else None


def make_request(request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                 **kwargs: Any) -> Request:
    return Request(request_id, prompt_token_ids, params or SamplingParams(temperature=0.0), **kwargs)


__all__ = ["Engine", "EngineConfig", "OutOfBlocksError", "make_request"]
