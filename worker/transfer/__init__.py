"""Moving cache blocks between instances: the transfer engine over a transport backend
(NIXL, or the explicit TCP fallback). The migration protocol on top (leases, pulls,
offers) is `triptych.worker.migration`."""

from triptych.worker.transfer.base import (
    Backend,
    BlockHandle,
    IncompatibleHandleError,
    PeerUnreachableError,
    TransferError,
    TransferTimeoutError,
    TransportUnavailableError,
)
from triptych.worker.transfer.engine import TransferEngine
from triptych.worker.transfer.transport import open_backend

__all__ = [
    "Backend",
    "BlockHandle",
    "IncompatibleHandleError",
    "PeerUnreachableError",
    "TransferEngine",
    "TransferError",
    "TransferTimeoutError",
    "TransportUnavailableError",
    "open_backend",
]
