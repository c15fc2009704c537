"""Transport-independent pieces of the transfer layer: errors, the block handle a source
hands to a target, the layout of a registered cache region, and the transfer metrics.

A region is one cache tensor allocated once and registered once (the KV cache
`[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]` or the MM cache
`[num_blocks, rows_per_block, hidden]`). Both are block-major, so block `i` is the byte
range `[base + i * block_nbytes, base + (i + 1) * block_nbytes)` and a run of adjacent
block ids is one contiguous range: one transfer descriptor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from prometheus_client import REGISTRY, Counter, Histogram
from pydantic import BaseModel, Field

MemType = Literal["DRAM", "VRAM"]
# Notifications carry this prefix so a source can tell lease confirmations apart from
# anything else a peer might send.
LEASE_NOTIF_PREFIX = b"triptych-lease:"


class TransferError(RuntimeError):
    """A transfer could not be done; the message names the peer and the cause."""


class TransportUnavailableError(TransferError):
    """The requested transport cannot be initialised here (message: the underlying error)."""


class TransferTimeoutError(TransferError, TimeoutError):
    """A transfer did not complete within its timeout; it was cancelled."""


class PeerUnreachableError(TransferError):
    """The peer's metadata is invalid or the peer cannot be connected to."""


class LeaseExpiredError(TransferError):
    """The handle's lease ends too soon for a READ to finish before it: the source may
    free (and reuse) the blocks mid-read, so nothing is read."""


class IncompatibleHandleError(TransferError, ValueError):
    """A handle does not fit the local region (transport, dtype, block shape, block count)."""


class BlockHandle(BaseModel):
    """What a source hands to a target so the target can pull blocks (HydraInfer §4.3,
    step 1): who holds them, where they are, and the lease to confirm when done.
    JSON-serialisable (`model_dump(mode="json")`); opaque to the router, and carried only
    over the authenticated internal plane (it holds the agent metadata and the lease
    secret). `block_ids` are the leased blocks only; `lease_secret` proves a TCP read
    and the confirmation come from the holder; `expires_at` (unix seconds) is when the
    lease ends minus a safety margin: a READ must be done by then."""

    transport: str
    agent_name: str
    agent_metadata: str  # base64 of the source's transport metadata
    region: str
    mem_type: MemType
    device_id: int = Field(ge=0)
    base_addr: int = Field(ge=0)
    block_nbytes: int = Field(gt=0)
    num_blocks: int = Field(gt=0)  # blocks in the source region (bounds check)
    block_ids: list[int]
    lease_id: str = Field(min_length=1)
    lease_secret: str = Field(min_length=1)
    expires_at: float
    dtype: str
    block_shape: list[int]

    @property
    def nbytes(self) -> int:
        return len(self.block_ids) * self.block_nbytes


@dataclass(frozen=True)
class Region:
    """A registered cache tensor; `tensor` is kept so its memory outlives the registration."""

    name: str
    tensor: torch.Tensor
    base_addr: int
    num_blocks: int
    block_nbytes: int
    mem_type: MemType
    device_id: int

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> Region:
        if not name:
            raise ValueError("region name must be non-empty")
        if tensor.dim() < 1 or tensor.shape[0] < 1:
            raise ValueError(f"region {name!r}: tensor needs a leading block dimension, got shape {tuple(tensor.shape)}")
        if not tensor.is_contiguous():
            raise ValueError(f"region {name!r}: tensor must be contiguous (block-major), got strides {tensor.stride()}")
        mem_type: MemType = "VRAM" if tensor.is_cuda else "DRAM"
        if tensor.device.type not in ("cpu", "cuda"):
            raise ValueError(f"region {name!r}: unsupported device {tensor.device}")
        return cls(
            name=name,
            tensor=tensor,
            base_addr=tensor.data_ptr(),
            num_blocks=tensor.shape[0],
            block_nbytes=tensor[0].numel() * tensor.element_size(),
            mem_type=mem_type,
            device_id=(tensor.device.index or 0) if tensor.is_cuda else 0,
        )

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_nbytes

    @property
    def dtype(self) -> str:
        return str(self.tensor.dtype).removeprefix("torch.")

    @property
    def block_shape(self) -> list[int]:
        return list(self.tensor.shape[1:])

    def addr(self, block_id: int) -> int:
        return self.base_addr + block_id * self.block_nbytes


@dataclass(frozen=True)
class Segment:
    """One contiguous copy: `nbytes` from the remote address to the local address."""

    remote_addr: int
    local_addr: int
    nbytes: int


class Backend(Protocol):
    """What a transport provides; `TransferEngine` does the block arithmetic around it."""

    transport: str

    def register(self, region: Region) -> None: ...
    # No more reads of a registered region (its cache is dropped; no lease is left on it).
    def deregister(self, region: Region) -> None: ...
    def metadata(self) -> bytes: ...
    # Reads of (addr, nbytes) ranges under a lease, until `deadline` (monotonic) or revoke.
    # A backend that cannot scope reads below a registered region (NIXL/UCX rkeys) ignores it.
    def grant(self, lease_id: str, secret: str, ranges: list[tuple[int, int]], deadline: float) -> None: ...
    def revoke(self, lease_id: str) -> None: ...
    def read(self, peer: str, peer_metadata: bytes, segments: list[Segment], remote_mem: MemType,
             remote_device: int, local_mem: MemType, local_device: int, deadline: float,
             lease: tuple[str, str]) -> None: ...
    # A backend may also offer `async read_async(...)` (same arguments), waiting on the event
    # loop instead of a thread (NIXL); `TransferEngine.pull_async` uses it where present.
    def notify(self, peer: str, peer_metadata: bytes, message: bytes) -> None: ...
    def notifications(self) -> list[bytes]: ...
    def close(self) -> None: ...


def segments(remote: BlockHandle, local: Region, local_block_ids: list[int]) -> list[Segment]:
    """One segment per run of blocks adjacent on both sides (coalesced descriptors)."""
    out: list[Segment] = []
    bn = remote.block_nbytes
    start = 0
    ids = list(zip(remote.block_ids, local_block_ids, strict=True))
    for i in range(1, len(ids) + 1):
        run_ends = i == len(ids) or ids[i] != (ids[i - 1][0] + 1, ids[i - 1][1] + 1)
        if run_ends:
            r0, l0 = ids[start]
            out.append(Segment(remote.base_addr + r0 * bn, local.addr(l0), (i - start) * bn))
            start = i
    return out


def check_compatible(handle: BlockHandle, local: Region, local_block_ids: list[int], transport: str) -> None:
    """Refuse a pull that would write garbage or out of bounds, before any byte moves."""
    where = f"handle for region {handle.region!r} of {handle.agent_name!r} -> local region {local.name!r}"
    if handle.transport != transport:
        raise IncompatibleHandleError(f"{where}: handle transport {handle.transport!r} != local {transport!r}")
    if (handle.dtype, handle.block_shape, handle.block_nbytes) != (local.dtype, local.block_shape, local.block_nbytes):
        raise IncompatibleHandleError(
            f"{where}: block layout differs: remote {handle.dtype}{handle.block_shape} "
            f"({handle.block_nbytes} B) vs local {local.dtype}{local.block_shape} ({local.block_nbytes} B)"
        )
    if len(local_block_ids) != len(handle.block_ids):
        raise IncompatibleHandleError(
            f"{where}: {len(handle.block_ids)} remote blocks but {len(local_block_ids)} local block ids"
        )
    bad_remote = [b for b in handle.block_ids if not 0 <= b < handle.num_blocks]
    if bad_remote:
        raise IncompatibleHandleError(f"{where}: remote block ids out of range [0, {handle.num_blocks}): {bad_remote}")
    bad_local = [b for b in local_block_ids if not 0 <= b < local.num_blocks]
    if bad_local:
        raise IncompatibleHandleError(f"{where}: local block ids out of range [0, {local.num_blocks}): {bad_local}")
    if len(set(local_block_ids)) != len(local_block_ids):
        raise IncompatibleHandleError(f"{where}: duplicate local block ids {local_block_ids}")


def registry_metric(cls: type, name: str, doc: str, labels: list[str], **kwargs: object):
    """Create a metric in the default registry, or return the one already there.

    The worker server exposes the default registry; this module can be imported under
    two names (e.g. in tests), and a second registration of the same name would raise."""
    try:
        return cls(name, doc, labels, **kwargs)
    except ValueError:
        # prometheus_client keeps no public lookup; counters register without `_total`.
        names = REGISTRY._names_to_collectors
        existing = names.get(name) or names.get(name.removesuffix("_total"))
        if existing is None:
            raise
        return existing


_LABELS = ["transport", "direction", "region"]
TRANSFER_BYTES: Counter = registry_metric(
    Counter, "triptych_worker_transfer_bytes_total", "Bytes moved between instances", _LABELS)
TRANSFER_SECONDS: Histogram = registry_metric(
    Histogram, "triptych_worker_transfer_seconds", "Wall time of one block transfer (post to completion)",
    _LABELS, buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0))
TRANSFER_FAILURES: Counter = registry_metric(
    Counter, "triptych_worker_transfer_failures_total", "Transfers that failed, by reason (timeout, error)",
    [*_LABELS, "reason"])
