"""An engine's configuration, and the cache sizes it implies."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field

from triptych.topology import InstanceType
from triptych.worker.engine.kv_cache import KVCache, blocks_for
from triptych.worker.engine.mm_cache import MMCache
from triptych.worker.models.spec import ModelSpec

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

DEFAULT_TOKEN_BUDGET = 2048
DEFAULT_IMAGE_BUDGET = 8


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    role: InstanceType = InstanceType.EPD
    dtype: str = Field(default="float32", pattern="^(float32|float16|bfloat16)$")
    device: str = "cpu"
    block_size: int = Field(default=16, ge=1)
    num_kv_blocks: int | None = Field(default=None, ge=1)
    kv_cache_bytes: int = Field(default=512 << 20, ge=1)  # used when num_kv_blocks is unset
    mm_block_rows: int = Field(default=64, ge=1)
    num_mm_blocks: int | None = Field(default=None, ge=1)
    mm_cache_bytes: int = Field(default=128 << 20, ge=1)
    max_num_seqs: int = Field(default=64, ge=1)
    token_budget: int | None = Field(default=None, ge=1)
    image_budget: int | None = Field(default=None, ge=1)
    encode_token_budget: int | None = Field(default=None, ge=1)  # scheduler.py SchedulerConfig
    ttft_slo_s: float | None = Field(default=None, gt=0)  # budgets by profiling (profiler.py)
    tbt_slo_s: float | None = Field(default=None, gt=0)
    max_model_len: int | None = Field(default=None, ge=2)
    max_image_pixels: int = Field(default=4096 * 4096, ge=1)
    # Stream text deltas (`RequestOutput.new_text`) for every request. Requests with stop
    # strings are always detokenized as they go; the others only when `Request.text` is
    # read (the router detokenizes what it streams itself).
    detokenize: bool = False
    threads: int | None = Field(default=None, ge=1)
    # The CPUs the driver's step thread runs on (and the OpenMP threads it starts inherit):
    # cores of its own, away from the event loop and the router (triptych/cpu_binding.py).
    cpus: tuple[int, ...] | None = None
    # Stream a request's tokens N at a time after its first (vLLM's and SGLang's
    # --stream-interval): fewer stream writes per step for the worker's event loop, which
    # shares the GIL with the steps, and for the router; 1 streams every token at once.
    stream_interval: int = Field(default=1, ge=1)
    # A D instance holds an MM cache too, so that a switch to P (or PD) in place allocates
    # and registers nothing (EPDServe §3.2.4; the worker sets it: roles change at run time).
    keep_mm_cache: bool = False
    # Automatic prefix caching (prefix_cache.py): full KV blocks are kept, named by a hash
    # chain over token ids and image content hashes, and shared by later prompts.
    enable_prefix_caching: bool = True
    # Encodes on a side CUDA stream beside the language forward when a step has both
    # (HydraInfer §4.2; parallel_vision.py). CUDA only: a CPU keeps the sequential path.
    parallel_vision: bool = True
    # torch.compile the language model's elementwise work (norms, SiLU gate) used by every
    # decode and prefill step (models/compile.py). Off by default: compiling takes seconds
    # at start and pays little where GEMMs dominate the step; falls back to eager if
    # compiling fails (no compiler, unsupported backend).
    compile_decode: bool = False
    # Tests: scramble the free lists so block tables are non-contiguous.
    shuffle_seed: int | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


def make_kv_cache(cfg: EngineConfig, spec: ModelSpec, max_model_len: int) -> KVCache:
    """`num_kv_blocks`, else as many blocks as `kv_cache_bytes` holds (no more than
    max_num_seqs full-length sequences need)."""
    per_block = spec.num_layers * 2 * cfg.block_size * spec.num_kv_heads * spec.head_dim
    per_block *= torch.empty(0, dtype=cfg.torch_dtype).element_size()
    n = cfg.num_kv_blocks
    if n is None:
        enough = cfg.max_num_seqs * blocks_for(max_model_len, cfg.block_size)
        n = max(1, min(cfg.kv_cache_bytes // per_block, enough))
    return KVCache(num_blocks=n, num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
                   head_dim=spec.head_dim, block_size=cfg.block_size, dtype=cfg.torch_dtype,
                   device=cfg.device, shuffle_seed=cfg.shuffle_seed,
                   prefix_caching=cfg.enable_prefix_caching)


def make_mm_cache(cfg: EngineConfig, spec: ModelSpec, max_model_len: int) -> MMCache:
    per_block = cfg.mm_block_rows * spec.hidden_size * torch.empty(0, dtype=cfg.torch_dtype).element_size()
    n = cfg.num_mm_blocks
    if n is None:
        enough = cfg.max_num_seqs * blocks_for(max_model_len, cfg.mm_block_rows)
        n = max(1, min(cfg.mm_cache_bytes // per_block, enough))
    return MMCache(num_blocks=n, rows_per_block=cfg.mm_block_rows, hidden_size=spec.hidden_size,
                   dtype=cfg.torch_dtype, device=cfg.device, shuffle_seed=cfg.shuffle_seed)
