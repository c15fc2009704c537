"""Tokens of a running decode that another instance sampled: the target side of a
make-before-break migration (router/overlap.py).

A decode moving off an instance (a role switch or a drain) is handed over while it keeps
decoding there; the router streams the source's tokens to the client meanwhile, and this
instance pulls the KV as of the hand-over, admits the decode and samples it as any other,
streaming its tokens by output index. The router feeds it the tokens the source streamed
(`POST /internal/feed`): at its next step boundary the engine appends those that extend
the decode without streaming them again (`OutputProcessor.absorb_feeds`) and computes
their KV in one chunk with the next sample, so the decode catches up with its source in a
step however far behind it was. The router compares the tokens both sides streamed and cuts
over once this instance has caught up (it is computing the client's next token, or has it
already). Tokens are keyed by output index: a fed token at an index the decode already has
is dropped (counted in `mismatches` where it differs). Only decodes whose every token is a
function of its index (greedy, or seeded: `SamplingParams` keys the random stream by output
index) move this way, so both instances sample the same tokens.
"""

from __future__ import annotations

import threading


class TokenFeed:
    """Output tokens by index, put by the event loop, taken by the engine's step thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens: dict[int, int] = {}
        self.mismatches = 0  # fed tokens that differ from what the decode has at their index

    def put(self, start: int, token_ids: list[int]) -> None:
        with self._lock:
            for i, token in enumerate(token_ids, start=start):
                self._tokens.setdefault(i, token)

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
