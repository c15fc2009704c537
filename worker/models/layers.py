"""Decoder building blocks of the Llama / Qwen2 family, written against the paged KV cache.

Parameter names match the checkpoints' (`self_attn.q_proj`, `mlp.gate_proj`,
`input_layernorm`, ...) so weights load by name; the arithmetic follows transformers'
LlamaDecoderLayer / Qwen2VLDecoderLayer operation by operation (pre-norm residual
blocks, RMSNorm in float32, SwiGLU MLP, rotate-half RoPE, grouped-query attention).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.base import AttentionBackend, AttentionMetadata
from .linear_kernels import Linear, linear_kernel
from .rope import apply_rotary
from .spec import ModelSpec

ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.kernel = rms_norm  # compile.py swaps in a compiled one (shared by every norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.eps)


class MLP(nn.Module):
    """SwiGLU: down(act(gate(x)) * up(x))."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, i, bias = spec.hidden_size, spec.intermediate_size, spec.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.act = ACTIVATIONS[spec.hidden_act]
        self._gate_up: Linear | None = None  # set by fuse(), with the down projection's
        self._down: Linear | None = None
        # act(gate) * up; compile.py swaps in a compiled one when the activation is SiLU.
        self.act_mul = silu_mul if self.act is F.silu else (lambda gate, up: self.act(gate) * up)

    def fuse(self) -> None:
        """gate and up as one GEMM, and each GEMM's kernel (after the weights are loaded)."""
        self._gate_up = linear_kernel(self.gate_proj, self.up_proj)
        self._down = linear_kernel(self.down_proj)

    def kernels(self) -> list[Linear]:
        """Its GEMMs' kernels (none before `fuse`)."""
        return [k for k in (self._gate_up, self._down) if k is not None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._gate_up is None or self._down is None:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        gate, up = self._gate_up(x).split(self.gate_proj.out_features, dim=-1)
        return self._down(self.act_mul(gate, up))


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        h = spec.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=spec.o_bias)
        self._qkv: Linear | None = None  # set by fuse(), with the output projection's
        self._o: Linear | None = None

    def fuse(self) -> None:
        """q, k and v as one GEMM, and each GEMM's kernel (after the weights are loaded)."""
        self._qkv = linear_kernel(self.q_proj, self.k_proj, self.v_proj)
        self._o = linear_kernel(self.o_proj)

    def kernels(self) -> list[Linear]:
        """Its GEMMs' kernels (none before `fuse`)."""
        return [k for k in (self._qkv, self._o) if k is not None]

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        layer: int,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        if self._qkv is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            kv = self.num_kv_heads * self.head_dim
            q, k, v = self._qkv(x).split([self.num_heads * self.head_dim, kv, kv], dim=-1)
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = backend.forward(q, k, v, kv_cache, layer, meta).reshape(tokens, self.num_heads * self.head_dim)
        return self.o_proj(out) if self._o is None else self._o(out)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        layer: int,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, layer, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))
