"""How a hand-off fails, as types: callers map them to a status (worker/errors.py) and
never read the message to decide."""

from __future__ import annotations


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
