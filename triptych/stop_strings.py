"""Stop strings over streamed text: the one matcher the worker's engine and the router use.

Text arrives in pieces (the detokenized text of one or more tokens). After each piece the
text is cut at the EARLIEST START of any stop string that now occurs in it, and the
stream stops there; a match is only looked for at piece (= token) boundaries, so a stop
string that completes inside a piece still cuts at its own start, and of two stop strings
completing in one piece the one that starts first wins. Until a piece may be released,
the matcher holds back the longest tail of the text that is still a proper prefix of some
stop string (at most len(longest stop) - 1 characters), so a client never sees the start
of a stop string that then completes.

Cost: one Knuth-Morris-Pratt automaton per stop string, fed the new characters only
(amortized O(1) per character and stop string); the held-back tail is bounded by the
longest stop string, so a step's cost never grows with the length of the text so far.
Torch-free: the router imports it.
"""

from __future__ import annotations

from collections.abc import Sequence


def _failure(pattern: str) -> list[int]:
    """KMP failure function: fail[i] = length of the longest proper border of pattern[:i + 1]."""
    fail = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = fail[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        fail[i] = k
    return fail


class StopMatcher:
    """Incremental stop-string search. `add(piece)` returns the text that may be released
    now; once a stop string is found, `stopped` is True and later pieces are dropped.
    `flush()` releases the held-back tail at the end of the stream."""

    def __init__(self, stops: Sequence[str], include: bool = False) -> None:
        self._stops = [s for s in dict.fromkeys(stops) if s]
        self._include = include  # vLLM's include_stop_str_in_output: the cut falls after the stop string
        self._fail = [_failure(s) for s in self._stops]
        self._state = [0] * len(self._stops)  # matched prefix length of each stop string
        self._pending = ""  # held back: the longest text suffix that is a prefix of a stop
        self.stopped = False

    @property
    def longest(self) -> int:
        return max((len(s) for s in self._stops), default=0)

    def add(self, piece: str, *, check: bool = True) -> str:
        """Feed `piece`; return what can be released. With `check=False` the piece only
        advances the search (a stop string completed inside it is not acted on): the
        engine's first token on a decode instance, and text after an EOS token."""
        if self.stopped:
            return ""
        if not self._stops:
            return piece
        base = len(self._pending)
        text = self._pending + piece
        first: tuple[int, int] | None = None  # (start, end) of the earliest-starting match
        for k, stop in enumerate(self._stops):
            end = self._feed(k, piece, check)
            if end >= 0:
                start = base + end + 1 - len(stop)
                if first is None or start < first[0]:
                    first = (start, base + end + 1)
        if first is not None:
            self.stopped = True
            self._pending = ""
            return text[:first[1] if self._include else first[0]]
        hold = max(self._state)
        self._pending = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold]

    def flush(self) -> str:
        """The held-back tail, at the end of the stream (nothing once stopped)."""
        tail, self._pending = self._pending, ""
        return tail

    def _feed(self, k: int, piece: str, check: bool) -> int:
        """Advance stop string k's automaton over `piece`; the index in `piece` where its
        first occurrence ends (when `check`), else -1."""
        stop, fail, state = self._stops[k], self._fail[k], self._state[k]
        n = len(stop)
        for i, ch in enumerate(piece):
            while state and stop[state] != ch:
                state = fail[state - 1]
            if stop[state] == ch:
                state += 1
            if state == n:
                if check:
                    self._state[k] = 0
                    return i
                state = fail[n - 1]
        self._state[k] = state
        return -1
