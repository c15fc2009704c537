"""Our language model: embeddings, decoder blocks over the paged KV cache, norm, LM head.

No transformers modules: the math is ours (see layers.py), the weights are the
checkpoint's. One `forward` call runs one engine step for a whole batch of sequences
(prefill chunks and decodes mixed), as described by `AttentionMetadata`.
"""

from __future__ import annotations

import torch
from torch import nn

from ..attention.base import AttentionBackend, AttentionGeometry, AttentionMetadata
from ..attention.torch_backend import TorchAttention
from .layers import DecoderLayer, RMSNorm
from .linear_kernels import Linear, linear_kernel
from .rope import cos_sin, inv_freq
from .spec import ModelSpec


class LanguageModel(nn.Module):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.backend: AttentionBackend = backend or TorchAttention()
        self.register_buffer("inv_freq", inv_freq(spec.rope, spec.head_dim), persistent=False)
        self._lm_head: Linear | None = None  # set by fuse_projections()

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def reset_rope(self) -> None:
        """Recompute the (non-checkpoint) RoPE frequencies, in float32, on the model's device."""
        self.inv_freq = inv_freq(self.spec.rope, self.spec.head_dim).to(self.device)

    def fuse_projections(self) -> None:
        """Fuse each layer's q/k/v and gate/up projections into one GEMM each (layers.py)
        and give every GEMM its kernel (linear_kernels.py: oneDNN on CPU); call once the
        weights are loaded."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        self._lm_head = linear_kernel(self.lm_head)

    def gemm_kernels(self) -> list[Linear]:
        """One kernel of each GEMM shape (every layer has the first layer's shapes)."""
        if self._lm_head is None or not self.layers:
            return []  # not fused yet
        return [*self.layers[0].self_attn.kernels(), *self.layers[0].mlp.kernels(), self._lm_head]

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings `[T, H]` (placeholder rows are overwritten by the caller)."""
        return self.embed_tokens(token_ids.to(self.device))

    def forward(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states `[T, H]` (final norm applied) of one batched step.

        `positions` is `[T]` (RoPE) or `[3, T]` (M-RoPE); the step's K/V are written into
        `kv_cache` at `meta.slot_mapping`.
        """
        if embeds.shape[0] != meta.num_tokens:
            raise ValueError(f"{embeds.shape[0]} embeddings but metadata describes {meta.num_tokens} tokens")
        hidden = embeds.to(self.dtype)
        cos, sin = cos_sin(positions.to(self.device), self.inv_freq, self.spec.rope.mrope_section, self.dtype)
        spec = self.spec
        self.backend.plan(
            meta, AttentionGeometry(spec.num_heads, spec.num_kv_heads, spec.head_dim, self.dtype)
        )
        for index, layer in enumerate(self.layers):
            hidden = layer(hidden, cos, sin, kv_cache, index, meta, self.backend)
        return self.norm(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits `[N, V]` in float32."""
        return (self.lm_head(hidden) if self._lm_head is None else self._lm_head(hidden)).float()

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> torch.Tensor:
        """A zeroed cache `[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]`."""
        spec = self.spec
        shape = (num_blocks, spec.num_layers, 2, block_size, spec.num_kv_heads, spec.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)
