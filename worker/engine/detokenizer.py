"""Incremental detokenization and stop strings.

Decoding tokens one at a time breaks multi-byte characters and word-boundary spaces, so
(as vLLM does) we decode a small window `[prefix, read)` twice and emit the difference,
holding back text while it ends in an incomplete UTF-8 sequence (U+FFFD).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class DetokState:
    ids: list[int] = field(default_factory=list)
    prefix: int = 0
    read: int = 0


def detokenize_step(tokenizer: Any, state: DetokState, new_ids: list[int]) -> str:
    """Append `new_ids`; return the newly complete text."""
    state.ids.extend(new_ids)
    prefix_text = tokenizer.decode(state.ids[state.prefix:state.read], skip_special_tokens=True)
    full_text = tokenizer.decode(state.ids[state.prefix:], skip_special_tokens=True)
    if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
        state.prefix, state.read = state.read, len(state.ids)
        return full_text[len(prefix_text):]
    return ""


def find_stop(text: str, stops: list[str], search_from: int) -> int:
    """Index of the earliest stop string that ends at or after `search_from`, else -1."""
    best = -1
    for s in stops:
        i = text.find(s, max(0, search_from - len(s) + 1))
        if i != -1 and (best == -1 or i < best):
            best = i
    return best
