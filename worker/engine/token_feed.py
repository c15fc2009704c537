"""Tokens of a running decode that another instance sampled: the target side of a
make-before-break migration (router/overlap.py).

A decode moving off an instance (a role switch or a drain) is handed over while it keeps
decoding there; the router streams the source's tokens to the client meanwhile, and this
instance pulls the KV as of the hand-over and admits the decode. Until the router cuts
over, the decode here *follows*: it samples nothing (the scheduler leaves its last token
uncomputed). The cut-over (`POST /internal/feed` with `lead`) brings the tokens the source
streamed since the hand-over and the decode's length from then on: the engine appends them
at its next step boundary without streaming them again (`OutputProcessor.absorb_feeds`),
computes their KV in one chunk with the next sample, and the stream goes on from exactly
there. Tokens are keyed by output index, so a repeated feed changes nothing. Only decodes
whose every token is a function of its index (greedy, or seeded: `SamplingParams` keys
the random stream by output index) move this way, so both instances hold the same tokens.
"""

from __future__ import annotations

import threading


class TokenFeed:
    """Output tokens by index, put by the event loop, taken by the engine's step thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens: dict[int, int] = {}
        self.mismatches = 0  # fed tokens that differ from what the decode has at their index
        self.lead_at: int | None = None  # the cut: sample once the decode holds this many tokens

    def put(self, start: int, token_ids: list[int], lead: bool = False) -> None:
        with self._lock:
            for i, token in enumerate(token_ids, start=start):
                self._tokens.setdefault(i, token)
            if lead:
                self.lead_at = start + len(token_ids)

    def following(self, num_output_tokens: int) -> bool:
        """Whether a decode holding `num_output_tokens` must not sample yet: no cut, or fed
        tokens before the cut still to come."""
        lead_at = self.lead_at
        return lead_at is None or num_output_tokens < lead_at

    def take(self, have: list[int]) -> list[int]:
        """The fed tokens that extend `have` (the decode's output tokens), in order, up to
        the first index not fed yet. Tokens at indices `have` already covers are dropped
        (counted in `mismatches` where they differ)."""
        with self._lock:
            n = len(have)
            for i in [i for i in self._tokens if i < n]:
                self.mismatches += self._tokens.pop(i) != have[i]
            out = []
            while n in self._tokens:
                out.append(self._tokens.pop(n))
                n += 1
            return out
