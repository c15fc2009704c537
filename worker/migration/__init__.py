"""Pull-based migration between instances (HydraInfer §4.3): one home for the offer ->
pull -> confirm -> free of both hand-offs (E->P embeddings, P->D KV)."""

from triptych.worker.migration.errors import (
    BadHandleError,
    HandoffExpiredError,
    MigrationError,
    NoFreeBlocksError,
    PullFailedError,
)
from triptych.worker.migration.leases import LeaseTable, pump_once, run_lease_pump
from triptych.worker.migration.service import BlockStore, BlockTransfer, MigrationService

__all__ = [
    "BadHandleError", "BlockStore", "HandoffExpiredError", "BlockTransfer", "LeaseTable", "MigrationError", "MigrationService",
    "NoFreeBlocksError", "PullFailedError", "pump_once", "run_lease_pump",
]
