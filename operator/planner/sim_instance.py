"""One simulated instance: the engine scheduler's stage-level batching, step by step.

Each step follows worker/engine/scheduler.py (TriInfer Alg. 1, HydraInfer §4.2): every
running decode (one token each against the token budget), then prefill chunks in arrival
order up to the remaining token budget, then image encodes up to the image budget. The
budgets come from the SLO as in worker/engine/profiler.py (Alg. 1 lines 1-5): a step of an
E, EP or P instance stays under alpha * TTFT SLO, of any decoding type under the TBT SLO.

Simplifications, each chosen so the model stays fast and on the safe side:
- a decode reserves KV for its whole prompt plus output when it is admitted (the engine
  allocates as it goes and preempts with recompute when full); admission waits for room
  and for a free seat under max_num_seqs (the engine seats handed-over requests at once;
  TriInfer Alg. 2 line 9 caps the decode batch the same way);
- a prompt prefills once all its images are encoded (the engine may prefill the text
  before the first image meanwhile);
- while an instance runs decodes only, steps that would look alike are taken together up
  to the next event anywhere (a "macro step"), all with the duration of the middle one;
- a request's work besides the steps (`request_work_s`: on a CPU instance its stage run's
  HTTP, image decode and pulls, which the worker does before the engine sees the request)
  runs before the request queues, sharing the instance's CPU equally with the other
  requests' work and a step under way (processor sharing, as CFS shares one capped
  process between its busy threads), and sets that step back by what it got, owed by the
  next step (`advance_takings`).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

from triptych.operator.planner.profile import StepProfile
from triptych.topology import InstanceType, Stage


@dataclass(eq=False)
class SimRequest:
    rid: int
    arrival: float
    image_tokens: list[int]  # LLM tokens per image
    image_pixels: list[int]
    text_tokens: int
    output_tokens: int
    # the path the router planned
    encoders: list[SimInstance] = field(default_factory=list)  # per image
    prefiller: SimInstance | None = None
    decoder: SimInstance | None = None
    # progress
    images_left: int = 0
    prefilled: int = 0
    first_token: float | None = None
    finish: float | None = None
    first_gap: float | None = None
    gaps: int = 0
    slow_gaps: int = 0
    # decode bookkeeping (per-instance counters at admission)
    steps_at_admit: int = 0
    slow_at_admit: int = 0
    kv_reserved: int = 0
    first_step_slow: int = 0
    missed: bool = False
    visited: set[int] = field(default_factory=set)  # ids of instances that started work on it

    @property
    def prompt_tokens(self) -> int:
        return self.text_tokens + sum(self.image_tokens)


@dataclass
class Batch:
    decodes: int = 0
    context: float = 0.0
    chunks: list[tuple[SimRequest, int]] = field(default_factory=list)
    encodes: list[tuple[SimRequest, int]] = field(default_factory=list)
    steps: int = 1  # > 1: a macro step of identical decode-only steps
    duration: float = 0.0


class SimInstance:
    def __init__(self, name: str, kind: InstanceType, profile: StepProfile, *, token_budget: int,
                 image_budget: int, tbt_slo_s: float, request_work_s: float = 0.0,
                 request_work_beside: bool = True) -> None:
        self.name, self.kind, self.profile = name, kind, profile
        self.request_work_s = request_work_s  # busy time per request taken on (its stage run's HTTP, I/O)
        self.request_work_beside = request_work_beside  # done before the request queues (`advance_takings`)
        self.owed = 0.0  # step time lost to request work done beside a step, paid by the next step
        self.taking: dict[SimRequest, float] = {}  # requests doing their request work here: work left
        self._taking_clock = 0.0
        self.taking_event = 0  # the current completion event's token (earlier ones are stale)
        self.token_budget, self.image_budget = token_budget, image_budget
        self.tbt_slo_s = tbt_slo_s
        self.encode_queue: deque[tuple[SimRequest, int]] = deque()
        self.prefill_queue: deque[SimRequest] = deque()
        self.decode_waiting: deque[SimRequest] = deque()
        self.decoding: list[SimRequest] = []
        self._finish_heap: list[tuple[int, int, SimRequest]] = []
        self._new_decodes: list[SimRequest] = []
        self.context_sum = 0
        self.kv_used = 0
        self.steps = 0  # decode steps taken (every running decode got one token per step)
        self.slow_steps = 0  # of those, longer than the TBT SLO
        self.busy = False
        self.busy_time = 0.0
        self.inflight = 0  # requests routed here and not done here

    def runs(self, stage: Stage) -> bool:
        return self.kind.runs(stage)

    # --- load, as the router's least-loaded policy sees it (queued tokens + images) ----------
    @property
    def load(self) -> float:
        pending = sum(r.prompt_tokens - r.prefilled for r in self.prefill_queue)
        return pending + len(self.encode_queue) + len(self.decoding) + len(self.decode_waiting)

    def queued(self) -> dict[str, float]:
        return {"encode_images": len(self.encode_queue),
                "prefill_tokens": sum(r.prompt_tokens - r.prefilled for r in self.prefill_queue),
                "decode_requests": len(self.decode_waiting) + len(self.decoding)}

    @property
    def has_work(self) -> bool:
        return bool(self.encode_queue or self.prefill_queue or self.decoding or self.decode_waiting)

    # --- Algorithm 1 --------------------------------------------------------------------
    def form_batch(self, now: float) -> Batch | None:
        self._admit_decodes()
        b = Batch(decodes=len(self.decoding))
        if b.decodes:
            b.context = self.context_sum / b.decodes
        tokens_left = self.token_budget - b.decodes
        for req in self.prefill_queue:
            if tokens_left <= 0:
                break
            n = min(req.prompt_tokens - req.prefilled, tokens_left)
            b.chunks.append((req, n))
            tokens_left -= n
        for i, task in enumerate(self.encode_queue):
            if i >= self.image_budget:
                break
            b.encodes.append(task)
        if not (b.decodes or b.chunks or b.encodes):
            return None
        p = self.profile
        pixels = sum(r.image_pixels[i] for r, i in b.encodes) / len(b.encodes) if b.encodes else 0.0
        b.duration = p.step_s(images=len(b.encodes), pixels=pixels,
                              prefill_tokens=sum(n for _, n in b.chunks), decodes=b.decodes, context=b.context)
        taken_on = self._take_on(b) if self.request_work_s and not self.request_work_beside else 0
        if self.owed:  # paid in a step of its own (not a macro step)
            b.duration += self.owed
            self.owed = 0.0
        elif taken_on:  # a step of its own: a macro step would repeat the work in every step
            b.duration += self.request_work_s * taken_on
        elif not b.chunks and not b.encodes:
            self._macro(b)
        return b

    def _take_on(self, b: Batch) -> int:
        """Requests this step starts work on here for the first time (their stage run's
        request handling is charged to it)."""
        me, new = id(self), 0
        for req in [*(r for r, _ in b.encodes), *(r for r, _ in b.chunks), *self._new_decodes]:
            if me not in req.visited:
                req.visited.add(me)
                new += 1
        return new

    # --- request work beside the steps (`request_work_beside`) ----------------------------
    def takes_on_beside(self, req: SimRequest) -> bool:
        """Whether `req`, reaching this instance, first does request work here (once per
        instance): its stage run's HTTP, image decode and pulls, which the worker does before
        the engine sees the request."""
        if not (self.request_work_beside and self.request_work_s) or id(self) in req.visited:
            return False
        req.visited.add(id(self))
        return True

    def advance_takings(self, now: float) -> None:
        """Bring the request work under way up to `now`. It shares the instance's CPU share
        equally with the other requests' work and, while a step runs, with the engine
        (processor sharing: what the CFS gives busy threads of one capped process). What it
        takes from a step sets the engine back, owed by the next step."""
        dt, self._taking_clock = now - self._taking_clock, now
        if dt <= 0 or not self.taking:
            return
        sharers = self._sharers
        for req in self.taking:
            self.taking[req] -= dt / sharers
        if self.busy:
            self.owed += dt * len(self.taking) / sharers
        else:
            self.busy_time += dt

    def next_taken(self, now: float) -> float | None:
        """When the request work under way first completes at the present sharing (after
        `advance_takings(now)`), or None."""
        if not self.taking:
            return None
        return now + max(0.0, min(self.taking.values())) * self._sharers

    @property
    def _sharers(self) -> int:
        """Who shares the instance's CPU: each request doing its work, and a step under way."""
        return len(self.taking) + (1 if self.busy else 0)

    def settle_owed(self) -> None:
        """No step followed the one the request work was shared with: it was only longer."""
        self.busy_time += self.owed
        self.owed = 0.0

    def _macro(self, b: Batch) -> None:
        """Decode-only steps up to the next finish; `truncate` cuts it short when work arrives."""
        k = max(1, self._finish_heap[0][0] - self.steps if self._finish_heap else 1)
        if k > 1:  # context grows by one token per decode per step: price the middle step
            b.duration = self.profile.step_s(decodes=b.decodes, context=b.context + k / 2)
        b.steps = k

    def _admit_decodes(self) -> None:
        cap, max_seqs = self.profile.kv_capacity_tokens, self.profile.max_num_seqs
        while self.decode_waiting and len(self.decoding) < max_seqs:
            req = self.decode_waiting[0]
            need = req.prompt_tokens + req.output_tokens
            if self.decoding and self.kv_used + need > cap:
                return  # pull-based: the request waits on its source until KV frees (TriInfer §4.3)
            self.decode_waiting.popleft()
            req.kv_reserved = need
            self.kv_used += need
            req.steps_at_admit, req.slow_at_admit = self.steps, self.slow_steps
            self.context_sum += req.prompt_tokens + 1
            self.decoding.append(req)
            self._new_decodes.append(req)
            # out_tokens - 1 decode steps after the first token (which the prefill made)
            heapq.heappush(self._finish_heap, (self.steps + req.output_tokens - 1, req.rid, req))

    @staticmethod
    def truncate(b: Batch, start: float, now: float) -> bool:
        """New work arrived during a macro step: end it at the first step boundary at or
        after `now`. True when it was shortened (the caller reschedules its end)."""
        if b.steps <= 1 or b.duration <= 0:
            return False
        k = max(1, math.ceil((now - start) / b.duration - 1e-9))
        if k >= b.steps:
            return False
        b.steps = k
        return True

    # --- the end of a step ----------------------------------------------------------------
    def finish_step(self, b: Batch, end: float) -> tuple[list[SimRequest], list[SimRequest], list[SimRequest]]:
        """Apply a step: (requests whose prefill finished, whose last image was encoded,
        whose decode finished)."""
        start = end - b.duration * b.steps
        self.busy_time += end - start
        decoded = self._finish_decodes(b, start) if b.decodes else []
        prefilled = []
        for req, n in b.chunks:
            req.prefilled += n
            if req.prefilled >= req.prompt_tokens:
                self.prefill_queue.remove(req)
                req.first_token = end
                prefilled.append(req)
        encoded = []
        for task in b.encodes:
            self.encode_queue.remove(task)
            req = task[0]
            req.images_left -= 1
            if req.images_left == 0:
                encoded.append(req)
        return prefilled, encoded, decoded

    def _finish_decodes(self, b: Batch, start: float) -> list[SimRequest]:
        d, k = b.duration, b.steps
        slow = 1 if d > self.tbt_slo_s else 0
        for req in self._new_decodes:  # the gap from the first token (made by the prefill) to the next
            req.first_gap = start + d - (req.first_token or start)
            req.first_step_slow = slow
        self._new_decodes.clear()
        steps_before, slow_before = self.steps, self.slow_steps
        self.steps += k
        self.slow_steps += k * slow
        self.context_sum += b.decodes * k
        done = []
        while self._finish_heap and self._finish_heap[0][0] <= self.steps:
            last, _, req = heapq.heappop(self._finish_heap)
            req.finish = start + (last - steps_before) * d
            n = last - req.steps_at_admit  # token gaps after the first token
            # Gap 1 is measured (it holds the PD migration and the wait for admission);
            # gaps 2..n are the durations of the request's later steps.
            slow_at_last = slow_before + (last - steps_before) * slow
            later = slow_at_last - req.slow_at_admit - req.first_step_slow
            req.gaps = n
            req.slow_gaps = (int((req.first_gap or 0.0) > self.tbt_slo_s) + later) if n else 0
            self.decoding.remove(req)
            self.kv_used -= req.kv_reserved
            self.context_sum -= req.prompt_tokens + n + 1
            done.append(req)
        return done
