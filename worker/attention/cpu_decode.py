"""Paged decode attention on CPU (fp32 or bf16 cache): a small C kernel (cpu_decode.c),
built here and called through ctypes.

The torch path batches decodes into padded `[B, L]` tensors (kept_context.py keeps them
across steps) and runs two batched GEMMs: with one query row per KV head and group, those
GEMMs are thin and bandwidth-bound, every row is padded to the longest, and the gathered
copy is as large as what attention reads. The kernel reads each sequence's real keys and
values once, where they sit in the paged cache (vLLM's CPU paged-attention kernels do the
same). On this project's 2-core machine the in-process engine made 1.24x the tokens/s with
it on a uniform load and 1.49x on a long-tailed one (docs/benchmarks.md, 2026-11-29).

Built on first use with the system C compiler (`cc`, or `$CC`) into
`$TRIPTYCH_CACHE/kernels` (default ~/.cache/triptych/kernels), under a name that hashes
the source, the flags and the CPU's flags, so a different machine or source rebuilds;
`TRIPTYCH_KERNEL_DIR` names a read-only folder searched first (an image's prebuilt
kernels). `TRIPTYCH_CPU_ATTENTION=torch` keeps the torch path; so does a machine without a
compiler or a writable folder (logged once). `TRIPTYCH_KERNEL_MARCH` (default `native`) builds for another CPU
level, e.g. `x86-64-v3` for an image that runs on any AVX2 machine.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from triptych.tiny_model import cache_root

log = logging.getLogger(__name__)

ENV = "TRIPTYCH_CPU_ATTENTION"  # "kernel" (default where it builds) or "torch"
SOURCE = Path(__file__).with_name("cpu_decode.c")
MAX_HEAD_DIM = 256  # cpu_decode.c's MAX_HEAD_DIM
# What each x86-64 level needs of the CPU (a kernel built for a level runs only there).
_LEVEL_FLAGS = {
    "x86-64-v3": {"avx2", "fma", "bmi2"},
    "x86-64-v4": {"avx512f", "avx512bw", "avx512dq", "avx512vl"},
}
_P = ctypes.c_void_p
_I64 = ctypes.c_int64


class KernelBuildError(RuntimeError):
    """The kernel could not be built or loaded here."""


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _march() -> str:
    """The first CPU level of `TRIPTYCH_KERNEL_MARCH` (comma-separated, default `native`)
    this CPU runs; KernelBuildError when it runs none of them."""
    levels = os.environ.get("TRIPTYCH_KERNEL_MARCH", "native").split(",")
    have = _cpu_flags()
    for level in levels:
        if not _LEVEL_FLAGS.get(level.strip(), set()) - have:
            return level.strip()
    missing = sorted(set().union(*(_LEVEL_FLAGS.get(x.strip(), set()) for x in levels)) - have)
    raise KernelBuildError(f"a kernel built for {','.join(levels)} needs {missing} of this CPU")


def _flags(march: str) -> list[str]:
    """The compile flags (the link takes only `LINK_FLAGS`).

    -ffast-math: vectorised expf (glibc's libmvec) and reassociated sums, as any two GEMM
    libraries differ in the order of their sums. At compile time only: linked with it, GCC
    adds crtfastmath.o, whose constructor sets flush-to-zero for the whole process when the
    library loads (every float op of torch and Python after it; hypothesis refused to run).
    -fopenmp: the sequences in parallel on torch's own OpenMP runtime (same soname, already
    loaded). GCC prefers 256-bit vectors even where AVX-512 exists; whole 512-bit ones
    measured faster here."""
    wide = march == "x86-64-v4" or (march == "native" and "avx512f" in _cpu_flags())
    return ["-O3", f"-march={march}", *(["-mprefer-vector-width=512"] if wide else []),
            "-ffast-math", "-fopenmp", "-fPIC"]


LINK_FLAGS = ["-shared", "-fopenmp"]


def _name(march: str) -> str:
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(_flags(march) + LINK_FLAGS).encode())
    if march == "native":  # the same source on another CPU builds its own
        digest.update(" ".join(sorted(_cpu_flags())).encode())
    return f"cpu_decode-{digest.hexdigest()[:16]}.so"


def build(out_dir: Path, march: str | None = None) -> Path:
    """Compile the kernel into `out_dir` (atomically: concurrent builders each write a
    temporary file and rename it into place). Raises KernelBuildError."""
    march = march or _march()
    target = out_dir / _name(march)
    if target.exists():
        return target
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise KernelBuildError("no C compiler (cc, gcc or $CC) on PATH")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
        os.close(fd)
    except OSError as exc:  # a read-only home, say
        raise KernelBuildError(f"cannot write {out_dir}: {exc}") from exc
    obj = tmp + ".o"
    try:
        _run([cc, *_flags(march), "-c", str(SOURCE), "-o", obj])
        link = [cc, *LINK_FLAGS, obj, "-o", tmp, "-lm"]
        if not _run([*link, "-lmvec"], check=False):  # libmvec: glibc's vector expf, where it exists
            _run(link)
        os.chmod(tmp, 0o755)  # mkstemp's 0600 would hide an image's kernel from its user
        os.replace(tmp, target)
        return target
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KernelBuildError(f"building {SOURCE.name} failed: {exc}") from exc
    finally:
        for path in (tmp, obj):
            if os.path.exists(path):
                os.unlink(path)


def _run(cmd: list[str], check: bool = True) -> bool:
    """Run one compiler command; with `check`, a failure is a KernelBuildError naming it."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if done.returncode != 0 and check:
        raise KernelBuildError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")
    return done.returncode == 0


def _load() -> ctypes.CDLL:
    march = _march()
    prebuilt = os.environ.get("TRIPTYCH_KERNEL_DIR")
    path = Path(prebuilt) / _name(march) if prebuilt else None
    if path is None or not path.exists():
        path = build(cache_root() / "kernels", march)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise KernelBuildError(f"loading {path} failed: {exc}") from exc
    fn = lib.paged_decode
    fn.restype = ctypes.c_int
    fn.argtypes = [_P, _I64, _P, _P, ctypes.c_int, _I64, _I64, _P, _I64, _P, _P, _I64,
                   _I64, _I64, _I64, _I64, _I64, _I64, ctypes.c_float, ctypes.c_int, _P]
    return lib


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The loaded kernel, or None where it is switched off or cannot be built (logged once)."""
    if os.environ.get(ENV, "kernel") == "torch":
        return None
    try:
        return _load()
    except (KernelBuildError, OSError) as exc:  # OSError: the source unreadable, say
        log.warning("CPU decode attention kernel unavailable (%s); using the torch path", exc)
        return None


CACHE_DTYPES = (torch.float32, torch.bfloat16)


def kernel_serves(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """The kernel serves this cache: fp32 or bf16 on CPU, a head size it handles, and it builds."""
    return device.type == "cpu" and dtype in CACHE_DTYPES and head_dim <= MAX_HEAD_DIM and kernel() is not None


class PagedDecode:
    """One step's decode rows, planned once and run for every layer."""

    def __init__(self, rows: list[int], tables: torch.Tensor, lens: list[int]) -> None:
        self.rows = torch.tensor(rows, dtype=torch.int64)
        self.tables = tables.to(torch.int32).contiguous()  # [B, max_blocks]
        self.lens = torch.tensor(lens, dtype=torch.int32)
        self.max_len = max(lens)
        self._scratch: torch.Tensor | None = None

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor, layer: int, out: torch.Tensor,
                 num_kv_heads: int) -> None:
        """Attend each decode row of `q` `[T, heads, head_dim]` to its context in `layer` of
        `kv_cache` (base.py's layout, fp32 or bf16); write its row of `out` (like `q`). The
        arithmetic is fp32; a bf16 model's queries and outputs are converted here (a few KB)."""
        lib = kernel()
        if lib is None or kv_cache.dtype not in CACHE_DTYPES or not kv_cache[0, layer].is_contiguous():
            raise ValueError("the CPU decode kernel needs a loaded kernel and a contiguous fp32 or bf16 cache")
        result = out
        if q.dtype != torch.float32:
            q = q.float()
        if out.dtype != torch.float32:
            out = torch.empty(out.shape, dtype=torch.float32)
        q = q.contiguous()
        heads, head_dim = q.shape[1], q.shape[2]
        threads = torch.get_num_threads()
        size = threads * heads * self.max_len
        if self._scratch is None or self._scratch.numel() < size:
            self._scratch = torch.empty(size, dtype=torch.float32)
        layer_kv = kv_cache[:, layer]  # [blocks, 2, block_size, kv_heads, head_dim]
        status = lib.paged_decode(
            q.data_ptr(), q.stride(0), self.rows.data_ptr(), layer_kv.data_ptr(),
            int(kv_cache.dtype == torch.bfloat16), layer_kv.stride(0),
            layer_kv.stride(1), self.tables.data_ptr(), self.tables.stride(0), self.lens.data_ptr(),
            out.data_ptr(), out.stride(0), len(self.rows), num_kv_heads, heads // num_kv_heads, head_dim,
            kv_cache.shape[3], self.max_len, head_dim ** -0.5, threads, self._scratch.data_ptr())
        if status != 0:
            raise ValueError("paged_decode refused the batch's shape")
        if result is not out:
            result.index_copy_(0, self.rows, out.index_select(0, self.rows).to(result.dtype))


def main(argv: list[str] | None = None) -> None:
    """`python -m triptych.worker.attention.cpu_decode --out DIR --march LEVEL[,LEVEL]`: build
    the kernel ahead of time (an image's build stage; `TRIPTYCH_KERNEL_DIR=DIR` at run time)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--march", default="native", help="CPU levels, comma-separated (e.g. x86-64-v4,x86-64-v3)")
    args = parser.parse_args(argv)
    for level in args.march.split(","):
        print(build(args.out, level.strip()))


if __name__ == "__main__":
    main()
