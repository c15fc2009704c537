"""Guided decoding: a request's grammar (structured output, forced tool calls) as a token
mask applied where its tokens are sampled.

The router compiles `response_format` / `tool_choice` into an llguidance grammar and
sends it with every stage request (`StageRequest.grammar`); each instance that samples
for the request builds its own `llguidance.LLMatcher` from it with the model's tokenizer.
The matcher is the only state, and it is a pure function of the grammar and the tokens
sampled so far, so a decode instance that takes over (the P -> D hand-off, or a migrated
decode) rebuilds it by replaying the tokens the earlier instances sampled (`replay`);
nothing of the matcher crosses the wire.

Masks are computed on the CPU per sampled row (`mask_logits`) and applied to the logits
before temperature / top-k / top-p, so a greedy or a seeded draw only ever picks a token
the grammar allows; a token the grammar does not allow can therefore never be sampled,
and `advance` only fails on a bug (reported as the request's error).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import llguidance
import numpy as np
import torch

from triptych.worker.engine.request import RequestValidationError


class GrammarError(RequestValidationError):
    """A grammar that does not compile for this model, or tokens it does not accept (a 400)."""


class GuideTokenizer:
    """The model's tokenizer as llguidance sees it, built once per engine (it indexes the
    whole vocabulary). `vocab_size` is the logits' width (it may exceed the tokenizer's)."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self._path = tokenizer_json
        self._eos = sorted(eos_ids)
        self._tok: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:  # admission runs in callers' threads
            if self._tok is None:
                if not self._path.is_file():
                    raise GrammarError("guided decoding needs the checkpoint's tokenizer.json")
                self._tok = llguidance.LLTokenizer(self._path.read_text(), n_vocab=self.vocab_size,
                                                   eos_token=self._eos or None)
            return self._tok

    def matcher(self, grammar: str, replay: Sequence[int] = ()) -> Guide:
        """A matcher for `grammar` that has consumed `replay` (tokens sampled elsewhere)."""
        m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise GrammarError(f"the grammar does not compile: {_first_line(m.get_error())}")
        guide = Guide(m, self.vocab_size)
        for token in replay:
            if not guide.advance(token):
                raise GrammarError(f"token {token} sampled earlier is not accepted by the grammar: "
                                   f"{_first_line(m.get_error())}")
        return guide


@dataclass
class Guide:
    """One request's matcher."""

    matcher: llguidance.LLMatcher
    vocab_size: int
    consumed: int = field(default=0)

    @property
    def finished(self) -> bool:
        """The grammar accepted and nothing else can follow (or EOS was consumed)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return _first_line(self.matcher.get_error()) if self.matcher.is_error() else None

    def advance(self, token: int) -> bool:
        ok = bool(self.matcher.consume_token(token))
        self.consumed += ok
        return ok

    def allowed(self) -> torch.Tensor:
        """Bool `[vocab_size]`: the tokens the grammar allows next."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: self.vocab_size]
        out = torch.zeros(self.vocab_size, dtype=torch.bool)
        out[: allowed.shape[0]] = torch.from_numpy(allowed.astype(bool))
        return out


def _first_line(error: str) -> str:
    """llguidance's error without the parser state dump that follows it."""
    return error.strip().splitlines()[0] if error.strip() else "unknown grammar error"


def mask_logits(logits: torch.Tensor, guides: Sequence[Guide | None]) -> torch.Tensor:
    """`logits` `[N, V]` with the tokens each row's guide forbids set to -inf (rows
    without a guide unchanged). A copy only when some row is guided."""
    rows = [(i, g) for i, g in enumerate(guides) if g is not None and not g.finished]
    if not rows:
        return logits
    mask = torch.ones(logits.shape, dtype=torch.bool)
    for i, g in rows:
        allowed = g.allowed()
        mask[i, : allowed.shape[0]] = ~allowed
        mask[i, allowed.shape[0]:] = True  # columns past the tokenizer's vocabulary
    keep = torch.ones(logits.shape[0], dtype=torch.bool)
    keep[[i for i, _ in rows]] = False
    mask[keep] = False
    return logits.masked_fill(mask.to(logits.device), float("-inf"))
