"""The GEMM behind each linear layer of the language model.

On CPU, `F.linear` runs MKL's sgemm, which repacks the weight on every call and, on AMD
CPUs, takes a code path well below the machine's AVX-512 peak: measured on this project's
2-core EPYC machine, a 1024^3 fp32 GEMM ran at 101 GFLOP/s on one core with `torch.mm`
and 249 with oneDNN; a decode batch's GEMMs (32 rows, this model's shapes) ran 2.2-2.8x
faster with oneDNN. So on CPU each weight is reordered once, at load, into oneDNN's
blocked layout and every call runs `mkldnn::_linear_pointwise` on it: what vLLM's CPU
backend and inductor's oneDNN fusions do. fp32 stays fp32 (IEEE accumulation; only the
order of the sums differs, as between any two GEMM libraries).

The reordered weight is a copy: the modules keep the checkpoint's tensors under their
names (state_dict, role changes and tests read them), so on CPU a language model holds
its linear weights twice. `TRIPTYCH_CPU_GEMM=torch` keeps `F.linear` and one copy.

oneDNN builds (JIT-compiles) a kernel for each new number of rows M, on first use, and
keeps it per thread: on this project's 4-layer test model a call at an M not seen before
took 0.9 ms and 140 page faults (the new code's pages) against 0.14 ms cached. Serving
meets new Ms whenever a batch changes, and an instance taking on more decodes than it
ever ran (a role switch moving 8 onto it) ran its next steps at 25-35 ms of CPU, 550-760
page faults each, against 7-9 ms (a quarter of a core: 110-150 ms apart instead of 30-45).
So `warm` builds the kernels of every decode batch size ahead of use, on the engine's
thread while it idles (driver.py). (Padding the rows up to a few sizes instead, so that
few kernels are ever built, cost 10% of the long-tailed load's throughput: a GEMM of 17
rows run as 24 costs about 24 rows' work.)
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

ENV = "TRIPTYCH_CPU_GEMM"  # "onednn" (default where available) or "torch"
DTYPES = (torch.float32, torch.bfloat16)
WARM_STOP_S = 0.05  # `warm` stops after a row count whose GEMMs took longer (CPU seconds)


@dataclass(frozen=True)
class TorchLinear:
    """`F.linear` over the module's own weight (GPUs; CPUs without oneDNN)."""

    weight: torch.Tensor
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


# A GEMM over a weight of at least PAD_BYTES with fewer rows than MIN_ROWS runs as MIN_ROWS
# (zeros below, cut off after). oneDNN picks its kernel by the row count, and those it picked
# for 1 and 2 rows streamed the weights slower than its 4-row one: the small Qwen2-VL's 33
# linears of a decode step, in order, took 8.0 / 9.4 / 6.8 / 6.3 / 6.3 ms at 1 / 2 / 3 / 4 /
# 5 rows (one thread, this project's AMD EPYC, 2026-12-06, docs/benchmarks.md). A decode of
# one or two streams is bound by reading the weights, so the extra rows' arithmetic costs
# nothing measurable there; a small weight is read from cache, and padding it only adds the
# copy (the tiny test model's step slowed from about 1.6 to 1.8-2.1 ms).
MIN_ROWS = 4
PAD_BYTES = 1 << 20


@dataclass(frozen=True)
class OneDNNLinear:
    """oneDNN's GEMM over a copy of the weight reordered into its blocked layout."""

    packed: torch.Tensor  # opaque mkldnn tensor
    bias: torch.Tensor | None
    min_rows: int = 1  # fewer rows run padded to this many (MIN_ROWS for a large weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        padded = rows < self.min_rows and x.dim() == 2
        if padded:
            x = torch.cat((x, x.new_zeros(self.min_rows - rows, x.shape[1])))
        out = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return out[:rows] if padded else out

    @property
    def in_features(self) -> int:
        return self.packed.size(1)


Linear = TorchLinear | OneDNNLinear


def onednn_usable(weight: torch.Tensor) -> bool:
    """oneDNN serves this weight: a CPU tensor of a dtype it runs fast (bf16 only where the
    CPU has native bf16: elsewhere oneDNN emulates it), a torch built with it, and not
    switched off by `TRIPTYCH_CPU_GEMM=torch`."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in DTYPES
        and os.environ.get(ENV, "onednn") != "torch"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and (weight.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


def linear_kernel(*linears: nn.Linear) -> Linear:
    """One kernel computing the linears' outputs side by side (their rows concatenated: a
    fused q/k/v or gate/up GEMM, or a single linear). Call once the weights are loaded.

    With `F.linear` the modules' weights become views into the fused tensor, so the
    checkpoint's names still hold the weights and nothing is stored twice. With oneDNN the
    kernel holds its own reordered copy beside the modules' weights. Fusing pays on CPU,
    where a decode step's small GEMMs run far below peak and a wider one less so; each
    output is the same dot product."""
    if len(linears) == 1:  # nothing to fuse: the module's own tensors
        weight, bias = linears[0].weight.detach(), linears[0].bias
        bias = None if bias is None else bias.detach()
    else:
        weight = torch.cat([m.weight.detach() for m in linears])
        bias = _fused_bias(linears, weight)
    if onednn_usable(weight):
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        except RuntimeError as exc:  # a oneDNN without this dtype (bf16 on older CPUs)
            log.warning("oneDNN linear unavailable for %s weights, using F.linear: %s", weight.dtype, exc)
        else:
            large = weight.numel() * weight.element_size() >= PAD_BYTES
            return OneDNNLinear(packed, bias, MIN_ROWS if large else 1)
    if len(linears) == 1:
        return TorchLinear(weight, bias)
    row = 0
    for m in linears:
        n = m.out_features
        m.weight = nn.Parameter(weight[row:row + n], requires_grad=False)
        if m.bias is not None:
            assert bias is not None
            m.bias = nn.Parameter(bias[row:row + n], requires_grad=False)
        row += n
    return TorchLinear(weight, bias)


def warm(kernels: list[Linear], max_rows: int) -> Iterator[int]:
    """Build the oneDNN kernels of `kernels` for every row count up to `max_rows`, one
    count per `next()` (it yields the count): on the thread that will run them (oneDNN
    keeps them per thread), a few ms of CPU each, so a caller can do it between other work.
    Kernels of one shape share theirs, so one of each shape is enough. It stops after a
    count whose GEMMs took over `WARM_STOP_S`: for a model that large a kernel's build is a
    small part of its first step anyway (0.29 / 0.70 s of CPU for all 64 counts of this
    project's tiny / small test models, 4-11 ms a count)."""
    onednn = [k for k in kernels if isinstance(k, OneDNNLinear)]
    if not onednn:
        return
    for rows in range(1, max_rows + 1):
        start = time.thread_time()
        with torch.inference_mode():
            for kernel in onednn:
                kernel(torch.zeros(rows, kernel.in_features, dtype=kernel.packed.dtype))
        took = time.thread_time() - start
        yield rows
        if took > WARM_STOP_S:
            return


def _fused_bias(linears: tuple[nn.Linear, ...], weight: torch.Tensor) -> torch.Tensor | None:
    biases = [m.bias for m in linears]
    if all(b is None for b in biases):
        return None
    return torch.cat([b.detach() if b is not None else weight.new_zeros(m.out_features)
                      for b, m in zip(biases, linears, strict=True)])
