"""A roofline stand-in for a measured profile (HydraInfer §3.2, Tables 1-2).

Each operator takes T = max(T_comp, T_mem) (HydraInfer §3.2): FLOPs over the GPU's peak
(times an achievable fraction), bytes over its memory bandwidth (likewise). Per layer, with
n new tokens, H the hidden size, M the heads, S a context length and B a batch:

| op | FLOPs | memory (elements) |
| --- | --- | --- |
| QKVO + FFN | 2 n W (Table 2: 8nH^2 + 16nH^2 when W = 12H^2) | W + 12 n H |
| prefill attention | 4 n^2 H | 4 n H + 2 n^2 M |
| decode attention | 4 B S H | 4 B S M + 2 B S H_kv (Table 2 has H for MHA) |

W is the layer's matmul weights counted from the config (GQA and gated MLPs make it
differ from 12H^2, the table's MHA/4H-MLP case). The vision tower is the encode row of
the same table with T patches per image; its merger/projector is one more matmul.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from triptych.operator.planner.model_shape import ModelShape
from triptych.operator.planner.profile import DecodeRow, EncodeRow, Migration, Point, StepProfile


class GPUSpec(BaseModel):
    model_config = ConfigDict(frozen=True)
    name: str
    flops: float  # dense bf16/fp16 FLOP/s
    mem_bw: float  # bytes/s
    mem_bytes: float
    link_bw: float  # bytes/s between two instances' GPUs (NVLink, else PCIe)


# Vendors' data sheets (dense, no sparsity): H100 SXM5 80 GB, H200 SXM 141 GB,
# A100 SXM4 80 GB, L40S 48 GB (PCIe Gen4 x16 between cards).
GPUS: dict[str, GPUSpec] = {g.name: g for g in (
    GPUSpec(name="H100", flops=989e12, mem_bw=3.35e12, mem_bytes=80e9, link_bw=450e9),
    GPUSpec(name="H200", flops=989e12, mem_bw=4.8e12, mem_bytes=141e9, link_bw=450e9),
    GPUSpec(name="A100", flops=312e12, mem_bw=2.039e12, mem_bytes=80e9, link_bw=300e9),
    GPUSpec(name="L40S", flops=362e12, mem_bw=0.864e12, mem_bytes=48e9, link_bw=32e9),
)}


class Efficiency(BaseModel):
    """Achievable fractions of peak; a fixed per-step cost for scheduling and launches."""

    model_config = ConfigDict(frozen=True)
    compute: float = 0.6
    memory: float = 0.8
    link: float = 0.7
    step_overhead_s: float = 0.002
    link_latency_s: float = 0.0005
    kv_memory_fraction: float = 0.9  # TriInfer Alg. 2 line 9: gamma


ENCODE_PIXELS = (224 * 224, 448 * 448, 896 * 896, 1344 * 1344, 2016 * 2016)
ENCODE_IMAGES = (1, 2, 4, 8, 16, 32, 64)
PREFILL_TOKENS = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
DECODE_CONTEXTS = (0, 256, 1024, 4096, 16384)
DECODE_BATCH = (1, 8, 32, 64, 128, 256, 512)


class Roofline:
    def __init__(self, shape: ModelShape, gpu: GPUSpec, eff: Efficiency | None = None,
                 dtype_bytes: int = 2) -> None:
        self.shape, self.gpu, self.eff, self.b = shape, gpu, eff or Efficiency(), dtype_bytes

    def _op(self, flops: float, elements: float) -> float:
        return max(flops / (self.gpu.flops * self.eff.compute),
                   elements * self.b / (self.gpu.mem_bw * self.eff.memory))

    # --- language model ---------------------------------------------------------------
    def prefill(self, n: int) -> float:
        """One chunk of n tokens of one request, context 0, sampling one token."""
        s = self.shape
        h, m = s.hidden_size, s.num_heads
        w = s.lm_linear_params
        layer = self._op(2 * n * w, w + 12 * n * h) + self._op(4 * n * n * h, 4 * n * h + 2 * n * n * m)
        return s.num_layers * layer + self._lm_head(1)

    def decode(self, batch: int, context: int) -> float:
        s = self.shape
        h, m, hkv = s.hidden_size, s.num_heads, s.num_kv_heads * s.head_dim
        w, ctx = s.lm_linear_params, max(1, context)
        linear = self._op(2 * batch * w, w + 12 * batch * h)
        attn = self._op(4 * batch * ctx * h, 4 * batch * ctx * m + 2 * batch * (ctx + 1) * hkv)
        return s.num_layers * (linear + attn) + self._lm_head(batch)

    def _lm_head(self, rows: int) -> float:
        s = self.shape
        return self._op(2 * rows * s.hidden_size * s.vocab_size, s.hidden_size * s.vocab_size)

    # --- vision tower -----------------------------------------------------------------
    def encode(self, images: int, pixels: int) -> float:
        s = self.shape
        side = int(pixels ** 0.5)
        t = s.patches_per_image(side, side)
        n, h, m = images * t, s.vision_hidden, s.vision_heads
        w = s.vision_linear_params
        layer = self._op(2 * n * w, w + 12 * n * h) + self._op(4 * images * t * t * h,
                                                                4 * n * h + 2 * images * t * t * m)
        merge_in = h * s.merge_size ** 2
        merger_w = merge_in * merge_in + merge_in * s.hidden_size
        merger = self._op(2 * (n // max(1, s.merge_size ** 2)) * merger_w, merger_w)
        return s.vision_layers * layer + merger

    # --- the profile ------------------------------------------------------------------
    def kv_capacity_tokens(self) -> int:
        s = self.shape
        free = self.gpu.mem_bytes * self.eff.kv_memory_fraction - s.lm_params * self.b
        if free <= 0:
            raise ValueError(f"{s.family} weights ({s.lm_params * self.b / 1e9:.1f} GB) do not fit "
                             f"one {self.gpu.name} ({self.gpu.mem_bytes / 1e9:.0f} GB)")
        return int(free // s.kv_bytes_per_token(self.b))

    def profile(self) -> StepProfile:
        return StepProfile(
            source=f"roofline:{self.gpu.name}", shape=self.shape, dtype_bytes=self.b,
            encode=[EncodeRow(pixels=p, points=[Point(x=n, seconds=self.encode(n, p)) for n in ENCODE_IMAGES])
                    for p in ENCODE_PIXELS],
            prefill=[Point(x=n, seconds=self.prefill(n)) for n in PREFILL_TOKENS],
            decode=[DecodeRow(context=c, points=[Point(x=b, seconds=self.decode(b, c)) for b in DECODE_BATCH])
                    for c in DECODE_CONTEXTS],
            migration=Migration(latency_s=self.eff.link_latency_s, bytes_per_s=self.gpu.link_bw * self.eff.link),
            step_overhead_s=self.eff.step_overhead_s, kv_capacity_tokens=self.kv_capacity_tokens(),
            max_num_seqs=256)


def roofline_profile(shape: ModelShape, gpu: str, eff: Efficiency | None = None) -> StepProfile:
    try:
        spec = GPUS[gpu.upper()]
    except KeyError:
        raise ValueError(f"unknown GPU {gpu!r}; known: {', '.join(GPUS)}") from None
    return Roofline(shape, spec, eff).profile()
