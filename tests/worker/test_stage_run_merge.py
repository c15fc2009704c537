"""A worker stream that fell behind sends what it owes as one `tokens` event per choice
(worker/stage_run.py `merge_tokens`); other events keep their place."""

from __future__ import annotations

from triptych.stage_protocol import FinishedEvent, TokenLogprob, TokensEvent
from triptych.worker.stage_run import merge_tokens


def test_consecutive_tokens_of_a_choice_merge_and_order_is_kept() -> None:
    events = [TokensEvent(token_ids=[1]), TokensEvent(token_ids=[2, 3]), TokensEvent(token_ids=[7], index=1),
              TokensEvent(token_ids=[4]), FinishedEvent(finish_reason="length")]
    merged = merge_tokens(events)
    assert [(type(e).__name__, getattr(e, "token_ids", None), e.index) for e in merged] == [
        ("TokensEvent", [1, 2, 3], 0), ("TokensEvent", [7], 1), ("TokensEvent", [4], 0),
        ("FinishedEvent", None, 0)]


def test_logprobs_merge_with_their_tokens() -> None:
    lps = [TokenLogprob(token=t, logprob=-1.0 * t) for t in (1, 2)]
    merged = merge_tokens([TokensEvent(token_ids=[1], logprobs=lps[:1]), TokensEvent(token_ids=[2], logprobs=lps[1:])])
    assert len(merged) == 1 and merged[0].token_ids == [1, 2] and merged[0].logprobs == lps


def test_indexed_tokens_merge_only_where_they_follow_on() -> None:
    """A takeover's stream (tokens with `start`): tokens fed to it between two of its own
    samples are not streamed, so those two events keep their own indices; a merged event
    would put the second sample at the wrong index (the router checks them by index)."""
    events = [TokensEvent(token_ids=[5], start=20), TokensEvent(token_ids=[6, 7], start=21),
              TokensEvent(token_ids=[9], start=30), TokensEvent(token_ids=[4])]
    merged = merge_tokens(events)
    assert [(e.token_ids, e.start) for e in merged] == [([5, 6, 7], 20), ([9], 30), ([4], None)]
