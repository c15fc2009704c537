"""Output processing: what a step's sampled tokens do to their requests.

After the forward, each sampled token is appended to its request, which then stops (a
stop token or EOS, its length, or a stop string; `triptych.stop_strings`), hands off
(prefill-only requests park with their KV blocks, encode-only ones with their
embeddings; HydraInfer §4.3), or goes on decoding. Each change becomes a
`RequestOutput` delta for the request's stream.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from triptych.topology import Stage
from triptych.worker.engine.batch import ScheduledBatch
from triptych.worker.engine.mm_cache import MMEntry
from triptych.worker.engine.model_runner import Sampled
from triptych.worker.engine.request import (
    HANDED_BACK,
    FinishReason,
    Handoff,
    Request,
    RequestOutput,
    RequestStatus,
)
from triptych.worker.engine.scheduler import Scheduler, update_status

MOVED_OUT_KEPT = 4096  # decodes remembered as moved out (bounded: an instance runs for months)


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, requests: dict[str, Request], in_use: set[str],
                 eos_ids: Iterable[int], max_model_len: int) -> None:
        self.scheduler = scheduler
        self.eos_ids = frozenset(eos_ids)
        self.max_model_len = max_model_len
        self._requests = requests  # the engine's: requests in the loop, by id
        self._in_use = in_use  # the engine's: request ids added and not finished
        # The decodes parked to migrate out, latest last (a switch reports them): id -> the
        # tokens its stream had by then (the next one is its new instance's first).
        self.moved_out: OrderedDict[str, int] = OrderedDict()
        # Decodes handed over live, by id: the tokens each had here when its stream let go
        # (its next instance streamed from a token at or before that one on).
        self.released: OrderedDict[str, int] = OrderedDict()

    def process(self, batch: ScheduledBatch, sampled: Sampled) -> list[RequestOutput]:
        """Advance every request of `batch` past what the step computed."""
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
            self.scheduler.cache_computed(req)
            got = sampled.get(id(req))
            if got is None:
                update_status(req, running=True)
                continue
            if not req.prefill_done:
                req.prefill_done = True
                req.timings.prefill_end = now
                req.status = RequestStatus.DECODING
            out = self.append_token(req, got[0], got[1], now)
            if out is not None:
                outputs.append(out)
        if num_decodes:
            counters.decode_steps += 1
            counters.decode_tokens += num_decodes
        return outputs

    def append_token(self, req: Request, token: int, logprob: dict | None, now: float) -> RequestOutput | None:
        req.output_token_ids.append(token)
        if logprob is not None:
            req.logprobs.append(logprob)
        req.timings.token_times.append(now)
        if req.timings.first_token is None:
            req.timings.first_token = now
        params = req.params
        reason: FinishReason | None = None
        if params.n > 1 and Stage.DECODE not in req.stages:
            pass  # n choices: the fork decides which of them the first token ends (worker/choices.py)
        elif token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_ids):
            reason = FinishReason.STOP
        elif req.guide is not None and not req.guide.advance(token):  # masking makes this a bug
            return self.finish(req, FinishReason.ERROR, f"token {token} is not allowed by the request's "
                                                        f"grammar: {req.guide.error}")
        elif req.guide is not None and req.guide.finished:  # accepted, and nothing can follow
            reason = FinishReason.STOP
        elif len(req.output_token_ids) >= params.max_tokens or req.num_tokens >= self.max_model_len:
            reason = FinishReason.LENGTH
        # Stop strings are not looked for in the text of a stop token or EOS, nor before
        # min_tokens (vLLM's rule; the sampler masks stop tokens until then).
        check = reason != FinishReason.STOP and len(req.output_token_ids) >= params.min_tokens and params.n == 1
        if self._add_text(req, token, last=reason is not None, check=check):
            reason = FinishReason.STOP
        if reason is not None:
            return self.finish(req, reason)
        if Stage.DECODE not in req.stages:
            # Prefill-only: hand the KV blocks (and token 1) to a D instance; keep them until release.
            handoff = Handoff(Stage.PREFILL, kv_block_ids=list(req.block_ids),
                              num_kv_tokens=req.num_computed_tokens, first_token=token)
            self.scheduler.park(req)
            req.handoff = handoff
            return self.output(req, finished=True, handoff=handoff)
        return self.output(req)

    def enter_decode(self, req: Request) -> None:
        """A request whose prompt KV was filled elsewhere starts at its first token."""
        pre = req.prefilled
        assert pre is not None
        req.block_ids = list(pre.block_ids)
        req.num_computed_tokens = pre.num_tokens
        # A migrated decode goes on at output index len(generated) + 1: seeds, max_tokens
        # and stop handling count from there.
        req.output_token_ids = [*pre.generated, pre.first_token]
        self.scheduler.counters.migrated_in += bool(pre.generated)
        req.prefill_done = True
        # Embeddings this engine never had: a recompute could not rebuild the prompt.
        req.recomputable = not req.mm_items
        # The instance that sampled them checked their text for stop strings already.
        for token in req.output_token_ids:
            self._add_text(req, token, last=False, check=False)

    def park_decodes(self) -> list[RequestOutput]:
        """Migrate out (EPDServe §3.2.4): every running decode parks with its KV blocks and
        the tokens it generated, for another decode instance to pull and go on from (a
        decode handed over live goes on here instead: `hand_over_live`)."""
        outputs = []
        for req in [r for r in self.scheduler.running if r.prefill_done and Stage.DECODE in r.stages
                    and not r.handed_over_live]:
            kv = self.scheduler.kv
            assert kv is not None and req.output_token_ids
            # Between steps the KV holds every token but the last sampled one.
            handoff = Handoff(Stage.DECODE, kv_block_ids=req.block_ids[:kv.blocks_for(req.num_computed_tokens)],
                              num_kv_tokens=req.num_computed_tokens, first_token=req.output_token_ids[-1],
                              generated=req.output_token_ids[:-1])
            self.scheduler.park(req)
            req.handoff = handoff
            self._moved_out(req)
            outputs.append(self.output(req, finished=True, handoff=handoff))
        return outputs

    def hand_over_live(self, req: Request, held: Any) -> RequestOutput:
        """Make-before-break (token_feed.py): the decode is handed over with its KV as of
        now (`held`: precopy.HeldKV, its references keep the blocks for the pull) and goes
        on decoding here, its stream open, until the stream lets go."""
        req.handed_over_live = True
        handoff = Handoff(Stage.DECODE, kv_block_ids=held.block_ids, num_kv_tokens=held.num_tokens,
                          first_token=req.output_token_ids[-1], generated=req.output_token_ids[:-1], held=held)
        self._moved_out(req)
        return self.output(req, handoff=handoff)

    def _moved_out(self, req: Request) -> None:
        self.scheduler.counters.migrated_out += 1
        _remember(self.moved_out, req.request_id, len(req.output_token_ids))

    def absorb_feeds(self) -> list[RequestOutput]:
        """Before a step: the tokens fed to migrated decodes (token_feed.py) join them, as
        tokens of their stream already sent (their KV is computed with the next sample);
        a decode ends where a fed token ends it (its source ended there too)."""
        outputs = []
        for req in [r for r in self.scheduler.running if r.feed is not None and r.prefill_done]:
            for token in req.feed.take(req.output_token_ids):
                out = self.append_token(req, token, None, time.monotonic())
                if out is not None and out.finished:
                    outputs.append(out)
                    break
        return outputs

    def hand_back(self) -> list[RequestOutput]:
        """Offload: queued requests that have not started end with HANDED_BACK (the router
        runs them elsewhere; nothing of them reached a client)."""
        # A request preempted after its first token has streamed tokens: it stays (and migrates).
        unstarted = [r for r in self.scheduler.waiting if r.prefilled is None and not r.output_token_ids]
        self.scheduler.counters.handed_back += len(unstarted)
        return [self.finish(r, FinishReason.ERROR, HANDED_BACK) for r in unstarted]

    def park_encoded(self, outputs: list[RequestOutput]) -> None:
        """Encode-only requests whose embeddings are all ready hand off (HydraInfer §4.3)."""
        for req in [r for r in self.scheduler.running if r.stop_after == Stage.ENCODE]:
            if all(e is not None and e.ready for e in req.mm_entries):
                seen: dict[str, MMEntry] = {e.content_hash: e for e in req.mm_entries if e is not None}
                handoff = Handoff(Stage.ENCODE, mm=[(h, list(e.block_ids), e.num_rows) for h, e in seen.items()])
                self.scheduler.park(req)
                req.handoff = handoff
                req.timings.encode_end = req.timings.encode_end or time.monotonic()
                outputs.append(self.output(req, [], finished=True, handoff=handoff))

    def finish(self, req: Request, reason: FinishReason | None, error: str | None = None) -> RequestOutput:
        """End a request wherever it is: out of every queue, every block freed."""
        self.scheduler.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.error = error
        req.timings.finished = time.monotonic()
        self._requests.pop(req.request_id, None)
        self._in_use.discard(req.request_id)
        if req.handed_over_live:
            _remember(self.released, req.request_id, len(req.output_token_ids))
        return self.output(req, finished=True)

    def output(self, req: Request, new_ids: list[int] | None = None, *, finished: bool = False,
               handoff: Handoff | None = None) -> RequestOutput:
        """The delta since the request's last output."""
        if new_ids is None:
            new_ids = req.output_token_ids[req.sent_token_len:]
        req.sent_token_len = len(req.output_token_ids)
        if finished and req.stop_matcher is not None:
            req.text_parts.append(req.stop_matcher.flush())  # the tail held back for a stop string
        new_text = "".join(req.text_parts[req.sent_text_len:])
        req.sent_text_len = len(req.text_parts)
        lps = req.logprobs[req.sent_logprobs_len:] if req.params.logprobs else None
        req.sent_logprobs_len = len(req.logprobs)
        return RequestOutput(
            request_id=req.request_id, new_token_ids=list(new_ids), new_text=new_text, finished=finished,
            finish_reason=req.finish_reason, error=req.error, handoff=handoff, logprobs=lps,
            num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=len(req.output_token_ids),
            timings=req.timings.as_dict() if finished else None)

    @staticmethod
    def _add_text(req: Request, token: int, *, last: bool, check: bool) -> bool:
        """Detokenize `token` if the request streams text; True when a stop string ends it.
        Only requests with stop strings (or an engine set to stream text) pay for this."""
        if req.detok is None:
            return False
        piece = req.detok.add(token)
        if last:
            piece += req.detok.flush()
        if req.stop_matcher is not None:
            piece = req.stop_matcher.add(piece, check=check)
        req.text_parts.append(piece)
        return req.stop_matcher is not None and req.stop_matcher.stopped


def _remember(kept: OrderedDict[str, int], request_id: str, num_tokens: int) -> None:
    kept[request_id] = num_tokens
    if len(kept) > MOVED_OUT_KEPT:
        kept.popitem(last=False)
