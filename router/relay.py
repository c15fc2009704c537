"""A stage stream's events as the client's token events.

A prefill's hand-over carries the first token of each choice; a decode stream carries
token events, `finished` per choice, and `migrating` when the instance hands a decode on
(EPDServe §3.2.4 role switching, or a drain). The orchestrator feeds each stream's events
through a `Relay` and goes on with whatever it kept as migrated.
"""

from __future__ import annotations

from triptych.router.backend import TokenEvent
from triptych.stage_protocol import KVSource, MigratingEvent, TokensEvent


class Relay:
    """One stage stream's token and migration events for a request of `n` choices: token
    events go on to the client (tagged with their choice); `finish` counts finished
    choices; decodes migrated off the instance are kept by choice for the caller."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.finished = 0
        self.migrated: dict[int, KVSource] = {}

    def finish(self) -> bool:
        """A choice finished; True when every choice not migrated has."""
        self.finished += 1
        return self.finished + len(self.migrated) >= self.n and not self.migrated

    def handed_on(self) -> bool:
        """Every choice left has moved on: nothing more comes on this stream for the request."""
        return bool(self.migrated) and self.finished + len(self.migrated) >= self.n

    def tokens(self, event: object) -> list[TokenEvent]:
        if isinstance(event, MigratingEvent):
            self.migrated[event.index] = event.kv
        elif isinstance(event, TokensEvent):
            return [TokenEvent(token_ids=event.token_ids, index=event.index, logprobs=event.logprobs)]
        return []


def first_tokens(kv: KVSource) -> list[TokenEvent]:
    """A prefill's hand-over: the first token of each choice (choice 0's is `first_token`)."""
    out = [TokenEvent(token_ids=[kv.first_token], logprobs=[kv.first_logprob] if kv.first_logprob else None)]
    out += [TokenEvent(token_ids=[c.token], index=i, logprobs=[c.logprob] if c.logprob else None)
            for i, c in enumerate(kv.choices, start=1)]
    return out
