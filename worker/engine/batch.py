"""What one engine step runs: the scheduler's batch (scheduler.py builds it, the model
runner runs it, the output processor reads it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from triptych.worker.engine.request import Request


@dataclass
class Chunk:
    """Tokens `[start, end)` of `req.all_token_ids` computed this step."""

    req: Request
    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the sequence: the next token is sampled from it."""
        return self.end == self.req.num_tokens


@dataclass
class ScheduledBatch:
    chunks: list[Chunk] = field(default_factory=list)
    encodes: list[tuple[Request, int]] = field(default_factory=list)  # (request, item index)
    failed: list[tuple[Request, str]] = field(default_factory=list)
    blocked_on_kv: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks and not self.encodes
