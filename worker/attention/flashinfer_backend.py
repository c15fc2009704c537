"""FlashInfer paged attention (CUDA only).

FlashInfer is imported lazily and only here; without CUDA (or without the package) the
import fails and `select_backend` falls back to TorchAttention. Each step is planned once
(`plan` builds the page-table CSR: indptr / page indices / last-page lengths) and every
layer runs the planned kernel on its own slice of the cache.

Our cache `[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]` gives, per layer,
K and V views `[num_blocks, block_size, kv_heads, head_dim]` ("NHD") whose page stride
spans all layers; FlashInfer's paged kernels read the page/token/head strides from the
tensors, so the views are passed as they are (no copy).
"""

from __future__ import annotations

from typing import Any

import torch

from .base import AttentionGeometry, AttentionMetadata, slot_indices, write_kv

_WORKSPACE_BYTES = 128 * 1024 * 1024


def import_flashinfer() -> Any:
    """The flashinfer module, or raise ImportError/RuntimeError when it cannot run here."""
    if not torch.cuda.is_available():
        raise RuntimeError("FlashInfer needs CUDA")
    import flashinfer  # GPU-only dependency, imported on demand

    return flashinfer


class FlashInferAttention:
    name = "flashinfer"

    def __init__(self, device: torch.device | str) -> None:
        self._fi = import_flashinfer()
        self.device = torch.device(device)
        workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._prefill = self._fi.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout="NHD")
        self._decode = self._fi.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout="NHD")
        self._wrapper: Any = None
        self._slots: tuple[torch.Tensor, torch.Tensor] | None = None

    def plan(self, meta: AttentionMetadata, geometry: AttentionGeometry) -> None:
        indptr, indices, last_len = _page_csr(meta, self.device)
        self._slots = slot_indices(meta)
        heads = (geometry.num_heads, geometry.num_kv_heads, geometry.head_dim, meta.block_size)
        dtypes = {"q_data_type": geometry.dtype, "kv_data_type": geometry.dtype}
        # Positional order is FlashInfer's plan() signature: (indptrs..., num_qo_heads,
        # num_kv_heads, head_dim, page_size); the head-dim keyword name differs by version.
        if meta.is_decode_only:
            self._decode.plan(indptr, indices, last_len, *heads, **dtypes)
            self._wrapper = self._decode
        else:
            qo_indptr = meta.cu_query_lens.to(self.device, torch.int32)
            self._prefill.plan(qo_indptr, indptr, indices, last_len, *heads, causal=True, **dtypes)
            self._wrapper = self._prefill

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        layer: int,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if self._wrapper is None or self._slots is None:
            raise RuntimeError("FlashInferAttention.plan() must be called before forward()")
        write_kv(kv_cache, layer, k, v, self._slots)
        paged = (kv_cache[:, layer, 0], kv_cache[:, layer, 1])
        return self._wrapper.run(q.contiguous(), paged)


def _page_csr(meta: AttentionMetadata, device: torch.device) -> tuple[torch.Tensor, ...]:
    """FlashInfer's page table: per-sequence used pages (CSR) and fill of the last page."""
    bs = meta.block_size
    indptr = [0]
    indices: list[int] = []
    last: list[int] = []
    for kv_len, table in zip(meta.kv_lens_list, meta.block_tables_list, strict=True):
        pages = -(-kv_len // bs)
        indices.extend(table[:pages])
        indptr.append(indptr[-1] + pages)
        last.append(kv_len - (pages - 1) * bs)

    def as_tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    return as_tensor(indptr), as_tensor(indices), as_tensor(last)
