"""How a hand-off fails, as types: callers map them to a status (worker/errors.py) and
never read the message to decide."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from triptych.worker.transfer.base import IncompatibleHandleError, LeaseExpiredError, TransferError


class MigrationError(Exception):
    """A hand-off could not be done; the message says which and why."""


class BadHandleError(MigrationError, ValueError):
    """The handle is malformed, or does not fit this instance (transport, block layout,
    block count): nothing was reserved or moved."""


class NoFreeBlocksError(MigrationError):
    """This instance has too few free blocks to receive the hand-off."""


class HandoffExpiredError(MigrationError):
    """The handle's lease ends before a pull could finish: nothing was read (the source
    may already be reusing the blocks). Retriable: the request is run again upstream."""


class PullFailedError(MigrationError):
    """The READ from the source failed (peer gone, timed out, transport error); the blocks
    reserved for it were freed."""


@contextmanager
def pull_errors(what: str) -> Iterator[None]:
    """Run a READ from a source instance, turning the transfer engine's failures into
    hand-off failures. `what` names the thing pulled in the messages ("pd blocks",
    "video part 3"). One home for every puller: the migration service (embeddings, KV)
    and the encode instance's video puller (worker/video_pull.py)."""
    try:
        yield
    except IncompatibleHandleError as exc:
        raise BadHandleError(f"{what}: handle does not fit this instance: {exc}") from exc
    except LeaseExpiredError as exc:
        raise HandoffExpiredError(f"{what}: hand-off expired before it could be pulled: {exc}") from exc
    except TransferError as exc:
        raise PullFailedError(f"pulling {what} failed: {exc}") from exc
