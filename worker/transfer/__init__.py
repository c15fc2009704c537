"""Moving KV-cache and embedding blocks between instances (NIXL; pull-based migration)."""

from triptych.worker.transfer.base import (
    BlockHandle,
    IncompatibleHandleError,
    PeerUnreachableError,
    TransferError,
    TransferTimeoutError,
    TransportUnavailableError,
)
from triptych.worker.transfer.migration import LeaseTable, pump_once, run_lease_pump
from triptych.worker.transfer.nixl import TransferEngine

__all__ = [
    "BlockHandle",
    "IncompatibleHandleError",
    "LeaseTable",
    "PeerUnreachableError",
    "TransferEngine",
    "TransferError",
    "TransferTimeoutError",
    "TransportUnavailableError",
    "pump_once",
    "run_lease_pump",
]
