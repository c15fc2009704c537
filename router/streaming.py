"""Token ids -> text as it streams: incremental detokenization, stop strings, SSE framing.

Detokenization follows vLLM's windowed scheme: decode a short window of recent tokens
twice (with and without the newest ones) and emit the difference, so a token decodes in
context (SentencePiece's leading-space rule) and a multi-byte character split across
tokens is held back until complete (a trailing U+FFFD means "incomplete") - the client
never sees a broken UTF-8 fragment. The concatenation of all emitted pieces equals
`decode(all_ids)` (checked in the tests).

Stop strings: the backend is asked to stop on them too, but the router is what trims
them from the text, and it holds back any tail that could still grow into a stop string.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

DONE = b"data: [DONE]\n\n"
_REPLACEMENT = "\ufffd"

Decode = Callable[[Sequence[int]], str]


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class IncrementalDetokenizer:
    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # tokens before this index have been emitted as text

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the newly completed text (possibly '')."""
        self.ids.extend(token_ids)
        if not token_ids:
            return ""
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        new_text = self._decode(self.ids[self._prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            self._prefix, self._read = self._read, len(self.ids)
            return new_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """The rest at the end of the sequence, even if it ends in an invalid byte run
        (then it holds U+FFFD exactly as a full decode would)."""
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        new_text = self._decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""


class OutputText:
    """The text of one completion: detokenized, cut at the first stop string.

    `add` and `finish` return what may be sent to the client now; after a stop string is
    seen `stopped` is True and the caller ends the request (finish_reason 'stop')."""

    def __init__(self, decode: Decode, stop: Sequence[str] = ()) -> None:
        self._detok = IncrementalDetokenizer(decode)
        self._stops = [s for s in stop if s]
        self._longest = max((len(s) for s in self._stops), default=0)
        self.text = ""
        self._sent = 0
        self.stopped = False

    @property
    def num_tokens(self) -> int:
        return len(self._detok.ids)

    def add(self, token_ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        self._append(self._detok.add(token_ids))
        return self._take(final=False)

    def finish(self) -> str:
        if not self.stopped:
            self._append(self._detok.flush())
        return self._take(final=True)

    def _append(self, piece: str) -> None:
        if not piece:
            return
        # A stop string can straddle the old end: search from where it could start.
        start = max(0, len(self.text) - self._longest + 1)
        self.text += piece
        cut = self._find_stop(start)
        if cut is not None:
            self.text = self.text[:cut]
            self.stopped = True

    def _find_stop(self, start: int) -> int | None:
        hits = [i for i in (self.text.find(s, start) for s in self._stops) if i >= 0]
        return min(hits) if hits else None

    def _take(self, final: bool) -> str:
        end = len(self.text) if (final or self.stopped) else len(self.text) - self._held_back()
        end = max(end, self._sent)
        piece, self._sent = self.text[self._sent:end], end
        return piece

    def _held_back(self) -> int:
        """Length of the longest tail that is a proper prefix of some stop string."""
        for k in range(min(self._longest - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0
