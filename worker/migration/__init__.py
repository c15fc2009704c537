"""Pull-based migration between instances (HydraInfer §4.3): one home for the offer ->
pull -> confirm -> free of both hand-offs (E->P embeddings, P->D KV).

The service (which knows the engine's block API) is imported on first use, so a V
instance (leases and errors only, worker/video_instance.py) never imports the engine."""

from triptych.worker.migration.errors import (
    BadHandleError,
    HandoffExpiredError,
    MigrationError,
    NoFreeBlocksError,
    PullFailedError,
    pull_errors,
)
from triptych.worker.migration.leases import LeaseTable, pump_once, run_lease_pump

__all__ = [
    "BadHandleError", "BlockStore", "HandoffExpiredError", "BlockTransfer", "LeaseTable", "MigrationError", "MigrationService",
    "NoFreeBlocksError", "PullFailedError", "pull_errors", "pump_once", "run_lease_pump",
]


_SERVICE = ("BlockStore", "BlockTransfer", "MigrationService")


def __getattr__(name: str) -> object:
    if name in _SERVICE:
        from triptych.worker.migration import service

        return getattr(service, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
