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


def fuse_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) holding the linears' rows in order; each linear's parameters
    become views into it, so the checkpoint's names still hold the weights and nothing is
    stored twice. One GEMM over the fused weight instead of one per projection: on CPU a
    decode step's small GEMMs run far below the machine's matmul peak, a wider one less so
    (each output element is still the same dot product over the same inputs)."""
    weight = torch.cat([m.weight.detach() for m in linears])
    biases = [m.bias for m in linears]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b.detach() if b is not None else weight.new_zeros(m.out_features)
                          for b, m in zip(biases, linears, strict=True)])
    row = 0
    for m in linears:
        n = m.out_features
        m.weight = nn.Parameter(weight[row:row + n], requires_grad=False)
        if m.bias is not None:
            assert bias is not None
            m.bias = nn.Parameter(bias[row:row + n], requires_grad=False)
        row += n
    return weight, bias


class MLP(nn.Module):
    """SwiGLU: down(act(gate(x)) * up(x))."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, i, bias = spec.hidden_size, spec.intermediate_size, spec.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.act = ACTIVATIONS[spec.hidden_act]
        self._gate_up: tuple[torch.Tensor, torch.Tensor | None] | None = None
        # act(gate) * up; compile.py swaps in a compiled one when the activation is SiLU.
        self.act_mul = silu_mul if self.act is F.silu else (lambda gate, up: self.act(gate) * up)

    def fuse(self) -> None:
        """gate and up as one GEMM (after the weights are loaded)."""
        self._gate_up = fuse_linears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._gate_up is None:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        gate, up = F.linear(x, *self._gate_up).split(self.gate_proj.out_features, dim=-1)
        return self.down_proj(self.act_mul(gate, up))


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        h = spec.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=spec.o_bias)
        self._qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def fuse(self) -> None:
        """q, k and v as one GEMM (after the weights are loaded)."""
        self._qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

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
            q, k, v = F.linear(x, *self._qkv).split([self.num_heads * self.head_dim, kv, kv], dim=-1)
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = backend.forward(q, k, v, kv_cache, layer, meta)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))


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
