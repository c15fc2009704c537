"""Tokens of a running decode that another instance sampled: the target side of a
make-before-break migration.

A decode moving off an instance (a role switch or a drain) is handed over while it keeps
decoding there; the router streams the source's tokens to the client and also feeds them
here (`POST /internal/feed`). Until the router cuts over, the decode here *follows*: the
engine appends each fed token at its next step boundary without streaming it again
(`OutputProcessor.absorb_feeds`) and computes their KV, but samples nothing (the
scheduler leaves the last token for later). The router cuts over right after it relayed
one of the source's tokens, once this instance has the decode in its engine: it closes
the source and sends the last feed with `lead`, the decode's length from then on; once
the decode holds that many tokens it samples the next one, and its stream goes on from
exactly there. The stream pauses for the cut alone (a feed call, the step in flight
here, one step), never for the pull or the admission. Tokens are keyed by output index,
so a repeated feed changes nothing. Only decodes whose every token is a function of its
index (greedy, or seeded: `SamplingParams` keys the random stream by output index) move
this way, so both instances hold the same tokens.
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
