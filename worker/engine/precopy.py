"""Live-migration pre-copy of running decodes (Clark et al., NSDI '05 §3, applied to KV
blocks): before a role switch or a drain parks its decodes, each running decode offers
the KV blocks already full — their KV never changes again — under an ordinary lease,
while it keeps decoding here; its next instance pulls them ahead, and the hand-over then
moves only the last, partial block(s). A mixin of `Engine` (engine.py), which owns the
requests, the KV cache, the lock and the driver.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from triptych.topology import Stage
from triptych.worker.engine.request import RequestOutput, RequestStatus

if TYPE_CHECKING:
    from triptych.worker.engine.driver import EngineDriver
    from triptych.worker.engine.kv_cache import KVCache
    from triptych.worker.engine.outputs import OutputProcessor
    from triptych.worker.engine.request import Request
    from triptych.worker.engine.scheduler import Scheduler


class PreCopy:
    kv: KVCache | None
    driver: EngineDriver
    output: OutputProcessor
    scheduler: Scheduler
    precopy_pending: set[str]  # decodes told to offer a pre-copy, not yet offered
    # Since `precopy()` until the decodes move out, every decode that starts here is told
    # too (`precopy_told`: each once): one whose KV pull was in flight at the request.
    precopy_armed: bool
    precopy_told: set[str]
    _requests: dict[str, Request]
    _inbox: Any
    _lock: threading.RLock

    def reset_precopy(self) -> None:
        self.precopy_pending, self.precopy_armed, self.precopy_told = set(), False, set()

    def precopy(self) -> None:
        """Live-migration pre-copy (switch or drain about to move the decodes): every running
        decode gets an output with `precopy` set, on which its stream offers the KV blocks
        already full (`hold_full_kv`) while the decode goes on here."""
        self._inbox.append(("precopy", None))
        self.driver.wake()

    def precopies_waiting(self) -> int:
        """Decodes told to offer a pre-copy that are still running here and have not yet."""
        with self._lock:
            self.precopy_pending &= self._decoding()
            return len(self.precopy_pending)

    def running_decodes(self) -> set[str]:
        """The ids of the requests decoding here now."""
        with self._lock:
            return self._decoding()

    def _decoding(self) -> set[str]:
        return {i for i, r in self._requests.items() if r.status == RequestStatus.DECODING}

    def skip_precopy(self, request_id: str) -> None:
        """The decode's stream offers no pre-copy (it moves whole at the hand-over)."""
        with self._lock:
            self.precopy_pending.discard(request_id)

    def hold_full_kv(self, request_id: str) -> HeldKV | None:
        """A reference to each full KV block of a running decode (their KV never changes
        again), for a pre-copy lease: the blocks stay valid whatever the request does next
        (finish, abort, park), until `HeldKV.release`. None when the request is not decoding
        here or has no full block."""
        with self._lock:
            self.precopy_pending.discard(request_id)
            req = self._requests.get(request_id)
            kv = self.kv
            if req is None or kv is None or req.status != RequestStatus.DECODING:
                return None
            full = req.num_computed_tokens // kv.block_size
            return self._hold(req, full * kv.block_size) if full else None

    def _hold(self, req: Request, num_tokens: int) -> HeldKV:
        """References to the blocks holding `req`'s first `num_tokens` tokens' KV."""
        kv = self.kv
        assert kv is not None
        block_ids = req.block_ids[:kv.blocks_for(num_tokens)]
        kv.touch(block_ids)
        return HeldKV(block_ids, num_tokens, req.all_token_ids[:num_tokens + 1], req.num_prompt_tokens,
                      _releaser(kv, block_ids, self._lock, self.driver.wake))

    def _move_out_decodes(self) -> list[RequestOutput]:
        """Migrate out (EPDServe §3.2.4) at this step boundary, on the step thread: a decode
        whose stream can merge two instances' tokens is handed over live with its KV as of
        now held for the pull, and goes on decoding here until its stream lets go
        (make-before-break, token_feed.py); every other decode parks."""
        self.precopy_armed, self.precopy_told = False, set()
        outputs = []
        for req in [r for r in self.scheduler.running if r.moves_live and not r.handed_over_live
                    and r.prefill_done and Stage.DECODE in r.stages]:
            # Between steps the KV holds every token but the last sampled one.
            outputs.append(self.output.hand_over_live(req, self._hold(req, req.num_computed_tokens)))
        return outputs + self.output.park_decodes()

    def _late_precopies(self) -> list[RequestOutput]:
        """At a step boundary while a pre-copy is asked for: the decodes that started since."""
        return self._precopy_outputs(again=False) if self.precopy_armed else []

    def live_handovers(self) -> set[str]:
        """Decodes handed over live that still run here (until their streams let go)."""
        with self._lock:
            return {i for i, r in self._requests.items() if r.handed_over_live}

    def _precopy_outputs(self, again: bool = True) -> list[RequestOutput]:
        """On the step thread: an output with `precopy` set for each running decode (`again`
        False: each one not told yet); from now on, each step boundary tells the decodes
        that started since."""
        if again:  # a new request: an earlier one's leases may have expired unpulled
            self.precopy_told = set()
        self.precopy_armed = True
        outputs = []
        for req in [r for r in self.scheduler.running if r.status == RequestStatus.DECODING
                    and Stage.DECODE in r.stages and r.request_id not in self.precopy_told]:
            self.precopy_told.add(req.request_id)
            self.precopy_pending.add(req.request_id)
            out = self.output.output(req)
            out.precopy = True
            outputs.append(out)
        return outputs


@dataclass
class HeldKV:
    """Full KV blocks of a running decode held for a pre-copy (`Engine.hold_full_kv`):
    `tokens` are the ones whose KV they hold, plus the token sampled after them."""

    block_ids: list[int]
    num_tokens: int
    tokens: list[int]
    num_prompt_tokens: int
    release: Callable[[], None]  # drop the references (once; later calls do nothing)


def _releaser(kv: Any, block_ids: list[int], lock: threading.RLock, wake: Callable[[], None]) -> Callable[[], None]:
    """Free `block_ids` in `kv` once — in that cache even after a role change replaced it."""
    done = [False]

    def release() -> None:
        with lock:
            if done[0]:
                return
            done[0] = True
            kv.free(block_ids)
        wake()
    return release
