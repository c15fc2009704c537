"""Zero-filled cache tensors that cost nothing until used.

`torch.zeros` on the CPU writes every byte: a 512 MiB KV cache takes ~0.4 s of page faults
and memset before the first request, which is most of an E -> D switch's onload (issue 9:
E <-> P/D within 700 ms). calloc (numpy's zeros) hands out large buffers as fresh
anonymous mappings, which the kernel guarantees to read as zeros and backs with memory
page by page on first touch; small ones it clears itself. Either way the cache reads as
zeros, which the attention's length masks rely on (a masked slot must not hold NaN).
"""

from __future__ import annotations

import math

import numpy as np
import torch


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """A zero tensor of `shape`; on the CPU its pages are committed on first touch."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)  # a device memset is fast
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    raw = torch.from_numpy(np.zeros(nbytes, dtype=np.uint8))  # calloc: lazily zeroed pages
    return raw.view(dtype).view(shape)
