"""Optional `torch.compile` of the language model's elementwise work (`--compile-decode`).

What is compiled: RMSNorm and SwiGLU's `silu(gate) * up`, as free functions shared by every
layer (one graph per function, dynamic in the token count, so decode batches of any size
and prefill chunks reuse it; compiling each module's `forward` would guard on every layer
and hit dynamo's recompile limit). The GEMMs and the paged attention stay eager: on CPU
the GEMMs are oneDNN/MKL calls either way, and the attention's planning is Python over
the batch. If compiling or running the compiled code fails (no C++ compiler, an
unsupported torch), the model falls back to eager for good, with a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .layers import MLP, RMSNorm, rms_norm, silu_mul

log = logging.getLogger(__name__)


class GuardedCompile:
    """`fn` compiled on first use; eager from the first failure on."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.eager = fn
        self.compiled: Callable[..., Any] | None = None
        self.failed = False
        try:
            self.compiled = torch.compile(fn, dynamic=True)
        except Exception as exc:  # torch without dynamo, unsupported Python
            self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        self.failed = True
        log.warning("torch.compile of %s unavailable, running eager: %s", self.eager.__name__, exc)

    def __call__(self, *args: Any) -> Any:
        if not self.failed and self.compiled is not None:
            try:
                return self.compiled(*args)
            except Exception as exc:  # the compiler (inductor needs a C++ toolchain on CPU)
                self._fail(exc)
        return self.eager(*args)


def compile_language_model(language: torch.nn.Module) -> dict[str, GuardedCompile]:
    """Swap the model's norms and SiLU gates for shared compiled kernels; returns them."""
    kernels = {"rms_norm": GuardedCompile(rms_norm), "silu_mul": GuardedCompile(silu_mul)}
    for module in language.modules():
        if isinstance(module, RMSNorm):
            module.kernel = kernels["rms_norm"]
        elif isinstance(module, MLP) and module.act is F.silu:
            module.act_mul = kernels["silu_mul"]
    return kernels
