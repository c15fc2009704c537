"""Attention backends over the paged KV cache (see base.py for the contract)."""

from __future__ import annotations

import logging

import torch

from .base import (
    AttentionBackend,
    AttentionGeometry,
    AttentionMetadata,
    AttentionMetadataError,
    build_metadata,
)
from .cpu_decode import kernel
from .torch_backend import TorchAttention

log = logging.getLogger(__name__)

# Head sizes FlashInfer's prebuilt paged kernels cover.
_FLASHINFER_HEAD_DIMS = (64, 128, 256)


_FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)


def select_backend(
    device: torch.device | str, head_dim: int | None = None, dtype: torch.dtype | None = None
) -> AttentionBackend:
    """FlashInfer on CUDA when it imports and supports `head_dim` and `dtype` (fp16/bf16),
    else the torch backend (on CPU with its decode kernel, for fp32 and bf16)."""
    device = torch.device(device)
    supported = (head_dim is None or head_dim in _FLASHINFER_HEAD_DIMS) and (
        dtype is None or dtype in _FLASHINFER_DTYPES
    )
    if device.type == "cuda" and supported:
        try:
            from .flashinfer_backend import FlashInferAttention

            return FlashInferAttention(device)
        except (ImportError, RuntimeError) as exc:
            log.warning("FlashInfer unavailable (%s); using the torch attention backend", exc)
    if device.type == "cpu" and dtype in (None, torch.float32, torch.bfloat16):
        kernel()  # built (or found) now, not at the first decode step (cpu_decode.py)
    return TorchAttention()


__all__ = [
    "AttentionBackend",
    "AttentionGeometry",
    "AttentionMetadata",
    "AttentionMetadataError",
    "TorchAttention",
    "build_metadata",
    "select_backend",
]
