"""Vision and language in parallel on one GPU (HydraInfer §4.2 "Batch Scheduler", with the
motivation of §3.1: "for encode and decode tasks in the same batch, we utilize multi-stream
execution to run the language model and vision model in parallel").

When a step's batch holds both encodes and language work (prefill chunks, decodes), the
encodes run on a side CUDA stream from a helper thread while the step's thread runs the
language forward on its own (current) stream. The two are independent within a step: a
prefill chunk covers only positions whose embeddings were committed in earlier steps
(scheduler.py), and an encode writes only MM cache entries that are not ready yet.

Ordering: the side stream first waits for the current stream (inputs and cache blocks
made by earlier work), and the encode's writes are waited on through an event before its
entries are committed, so nothing that reads a committed entry (the next step's forward,
an E -> P pull) sees rows still being written; the step's stream also waits on the event
before the next step is issued. A failed encode is reported only after the language
forward has returned, on the step's thread: failing a request frees its blocks, which the
forward may still be reading.

CUDA only (`make_parallel_vision`): on a CPU both would share the same cores, so the engine
keeps the sequential path there. `parallel_vision=False` in EngineConfig (worker flag
`--no-parallel-vision`) turns it off.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch


class ParallelVision:
    """Runs one step's encodes beside its language forward. On a CUDA device they go on a
    side stream; on any other device (tests of the threading path only) the encode runs on
    the helper thread with no stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="vision-stream")
        self.overlapped_steps = 0  # steps that ran encode and language side by side

    def overlap(self, encode: Callable[[Callable[[], None]], None],
                language: Callable[[], Any]) -> tuple[Future[Any], Future[None]]:
        """Start `encode(before_commit)` on the side stream, run `language()` here; returns
        both as finished futures (`.result()` raises what either raised, for the caller to
        handle on this thread once both are done)."""
        if self.stream is not None:
            # The side stream must see what the current stream wrote before this step.
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        done = torch.cuda.Event() if self.cuda else None
        encoded = self._pool.submit(self._encode, encode, done)
        lang: Future[Any] = Future()
        try:
            lang.set_result(language())
        except Exception as exc:  # handled by the caller, after the encode is done too
            lang.set_exception(exc)
        encoded.exception()  # waits: the step ends with both done
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)
        self.overlapped_steps += 1
        return lang, encoded

    def _encode(self, encode: Callable[[Callable[[], None]], None], done: Any) -> None:
        # inference_mode and the current stream are per thread: set both here.
        stream_ctx = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with torch.inference_mode(), stream_ctx:
            encode(lambda: _wait(done, self.stream))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _wait(done: Any, stream: Any) -> None:
    """Before commit: the encode's kernels and MM cache writes have finished."""
    if done is not None:
        done.record(stream)
        done.synchronize()


def make_parallel_vision(enabled: bool, device: torch.device, has_vision: bool,
                         has_language: bool) -> ParallelVision | None:
    """A ParallelVision where it pays: on CUDA, for an instance that both encodes and runs
    the language model (EP, EPD, ...); None keeps the sequential path."""
    if not (enabled and has_vision and has_language and device.type == "cuda" and torch.cuda.is_available()):
        return None
    return ParallelVision(device)
