"""The Python heap of a long-running process (router, worker): what its garbage collector
has to walk.

Importing torch and transformers and loading a model leave a few hundred thousand objects
that live as long as the process, and CPython's collector walks all of them in every full
collection. Measured with `gc.callbacks` in `triptych bench switch --instance-cpus 0.25`:
each worker's start ran six full collections of 0.1-0.8 s of wall time (2.7 s in all), and
the router, under load, stalled 75 ms in one. `collector_off` keeps the collector out of a
subcommand's imports (they make next to no cyclic garbage); `settle` collects once and
moves what is alive into the permanent generation (`gc.freeze`), which later collections
skip, once a server has what it keeps (vLLM's engine freezes its heap after start-up too).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_off() -> Iterator[None]:
    """No automatic collection inside (as it was after)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def settle() -> None:
    """Collect, then leave everything alive now out of later collections."""
    gc.collect()
    gc.freeze()
