"""The CPU paged decode kernel (worker/attention/cpu_decode.c): outputs against dense
attention over each sequence's K/V, the torch backend's use of it, and how it is built."""

from __future__ import annotations

import logging
import random
import subprocess
import sys

import pytest
import torch

from triptych.worker.attention import AttentionGeometry, TorchAttention, build_metadata, cpu_decode

needs_kernel = pytest.mark.skipif(cpu_decode.kernel() is None,
                                  reason="the CPU decode kernel does not build here (no C compiler)")


def _paged_case(kv_heads: int, group: int, dim: int, block_size: int, lens: list[int], seed: int = 0):
    """A shuffled paged cache with random K/V in layer 1 of 2, and the dense K/V per sequence."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    need = sum(-(-n // block_size) for n in lens)
    free = rng.sample(range(need + 3), need + 3)
    cache = torch.randn(need + 3, 2, 2, block_size, kv_heads, dim, generator=gen)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lens]
    dense = []
    for table, n in zip(tables, lens, strict=True):
        k = cache[table, 1, 0].reshape(-1, kv_heads, dim)[:n]
        v = cache[table, 1, 1].reshape(-1, kv_heads, dim)[:n]
        dense.append((k, v))
    return cache, tables, dense


def _dense_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int) -> torch.Tensor:
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    weights = (torch.einsum("hd,khd->hk", q, k) / q.shape[-1] ** 0.5).softmax(-1)
    return torch.einsum("hk,khd->hd", weights, v)


@needs_kernel
@pytest.mark.parametrize(("kv_heads", "group", "dim", "block_size"),
                         [(2, 2, 64, 16), (1, 7, 128, 16), (4, 1, 80, 1), (3, 4, 32, 5)])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_dense_attention(kv_heads: int, group: int, dim: int, block_size: int,
                                        threads: int) -> None:
    lens = [1, 37, 16, 300, 2, 17, 64]  # one position, block edges, a long row among short ones
    cache, tables, dense = _paged_case(kv_heads, group, dim, block_size, lens)
    width = max(map(len, tables))
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    # Decode rows among other tokens (a prefill chunk's rows), not in order.
    rows = [9, 0, 4, 12, 2, 7, 11]
    q = torch.randn(14, kv_heads * group, dim, generator=torch.Generator().manual_seed(1))
    out = torch.full_like(q, float("nan"))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cpu_decode.PagedDecode(rows, padded, lens)(q, cache, 1, out, kv_heads)
    finally:
        torch.set_num_threads(before)
    for row, (k, v) in zip(rows, dense, strict=True):
        assert (out[row] - _dense_decode(q[row], k, v, group)).abs().max() < 1e-5
    others = [r for r in range(14) if r not in rows]
    assert out[others].isnan().all()  # rows that are not decodes are left alone


@needs_kernel
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_kernel_reads_a_bf16_cache(model_dtype: torch.dtype) -> None:
    lens = [5, 40, 17]
    cache, tables, dense = _paged_case(2, 3, 64, 16, lens, seed=4)
    cache = cache.bfloat16()  # what the kernel reads; the reference uses the same rounded values
    q = torch.randn(3, 6, 64, generator=torch.Generator().manual_seed(2)).to(model_dtype)
    out = torch.zeros_like(q)
    width = max(map(len, tables))
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    cpu_decode.PagedDecode([2, 0, 1], padded, lens)(q, cache, 1, out, 2)
    tolerance = 1e-5 if model_dtype == torch.float32 else 2e-2  # a bf16 output's rounding
    for row, (k, v) in zip([2, 0, 1], dense, strict=True):
        want = _dense_decode(q[row].float(), k.bfloat16().float(), v.bfloat16().float(), 3)
        assert out.dtype == model_dtype and (out[row].float() - want).abs().max() < tolerance


@needs_kernel
def test_kernel_refuses_a_head_size_it_cannot_hold() -> None:
    cache, tables, _ = _paged_case(1, 1, 300, 4, [3])
    with pytest.raises(ValueError, match="refused"):
        cpu_decode.PagedDecode([0], torch.tensor(tables), [3])(torch.randn(1, 1, 300), cache, 1,
                                                               torch.empty(1, 1, 300), 1)
    with pytest.raises(ValueError, match="fp32 or bf16 cache"):
        cpu_decode.PagedDecode([0], torch.tensor(tables), [3])(torch.randn(1, 1, 300), cache.half(), 1,
                                                               torch.empty(1, 1, 300), 1)


@needs_kernel
def test_the_torch_backend_runs_fp32_and_bf16_cpu_decodes_through_the_kernel() -> None:
    backend = TorchAttention()
    meta = build_metadata([1, 5, 1], [9, 5, 3], [[3], [1], [2]], block_size=16)
    backend.plan(meta, AttentionGeometry(4, 2, 16, torch.float32))
    # the decodes' rows in q, and the 5-token chunk's, each seeing the cache up to itself
    assert backend._paged is not None and backend._paged.rows.tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert backend._paged.lens.tolist() == [9, 1, 2, 3, 4, 5, 3] and backend._prefills == []
    assert backend._kept.layout is None and backend._decodes == []
    backend.plan(meta, AttentionGeometry(4, 2, 16, torch.bfloat16))
    assert backend._paged is not None
    backend.plan(meta, AttentionGeometry(4, 2, 16, torch.float16))  # fp16: the torch path
    assert backend._paged is None and len(backend._decodes) == 1
    backend.plan(meta, AttentionGeometry(4, 2, 512, torch.float32))  # beyond the kernel's head size
    assert backend._paged is None


@needs_kernel
def test_loading_the_kernel_leaves_the_process_floating_point_state_alone(tmp_path) -> None:
    # Linked with -ffast-math, the library would set flush-to-zero for the whole process on
    # load (GCC's crtfastmath.o): subnormals become 0 in every op after it, torch's and Python's.
    code = ("import sys, ctypes; from triptych.worker.attention import cpu_decode as c; "
            "ctypes.CDLL(str(c.build(__import__('pathlib').Path(sys.argv[1])))); "
            "print(sys.float_info.min / 2 > 0, float(__import__('torch').tensor(1e-40) * 1.0) > 0)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["True", "True"], out.stderr[-2000:]


def test_a_compiler_that_fails_is_a_build_error_naming_the_command(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CC", "false")
    with pytest.raises(cpu_decode.KernelBuildError, match="false .*cpu_decode.c"):
        cpu_decode.build(tmp_path / "kernels")
    assert not list((tmp_path / "kernels").iterdir())  # no half-written library left
    (tmp_path / "a-file").write_text("")
    with pytest.raises(cpu_decode.KernelBuildError, match="cannot write"):  # e.g. a read-only home
        cpu_decode.build(tmp_path / "a-file" / "kernels")


def test_without_a_kernel_the_backend_says_so_once_and_keeps_the_torch_path(monkeypatch, caplog) -> None:
    def fail() -> None:
        raise cpu_decode.KernelBuildError("no C compiler (cc, gcc or $CC) on PATH")

    monkeypatch.setattr(cpu_decode, "_load", fail)
    with caplog.at_level(logging.WARNING):
        assert cpu_decode.kernel.__wrapped__() is None
    assert "no C compiler" in caplog.text and "torch path" in caplog.text
    monkeypatch.setenv(cpu_decode.ENV, "torch")
    monkeypatch.setattr(cpu_decode, "_load", lambda: pytest.fail("switched off: nothing is built"))
    assert cpu_decode.kernel.__wrapped__() is None


@needs_kernel
def test_a_build_is_reused_and_named_for_its_source_flags_and_cpu(tmp_path, monkeypatch) -> None:
    first = cpu_decode.build(tmp_path)
    assert cpu_decode.build(tmp_path) == first  # built once
    assert first.stat().st_mode & 0o777 == 0o755  # readable by another user (an image's)
    monkeypatch.setattr(cpu_decode, "_cpu_flags", lambda: {"sse2"})  # another machine
    assert cpu_decode._name("native") != first.name
    assert cpu_decode._name("x86-64-v3") == cpu_decode._name("x86-64-v3")  # a portable build: any CPU
    monkeypatch.setenv("TRIPTYCH_KERNEL_MARCH", "x86-64-v4")
    with pytest.raises(cpu_decode.KernelBuildError, match="needs .*avx512"):
        cpu_decode._load()
    # An image's kernels for two levels: the first this CPU runs is taken.
    monkeypatch.setattr(cpu_decode, "_cpu_flags", lambda: {"avx2", "fma", "bmi2"})
    monkeypatch.setenv("TRIPTYCH_KERNEL_MARCH", "x86-64-v4,x86-64-v3")
    assert cpu_decode._march() == "x86-64-v3"


@needs_kernel
def test_kernels_built_ahead_are_loaded_from_the_kernel_dir(tmp_path, monkeypatch, capsys) -> None:
    cpu_decode.main(["--out", str(tmp_path), "--march", "native"])
    built = capsys.readouterr().out.strip()
    assert built.startswith(str(tmp_path)) and built.endswith(".so")
    monkeypatch.setenv("TRIPTYCH_KERNEL_DIR", str(tmp_path))
    monkeypatch.setenv("TRIPTYCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", "false")  # nothing is compiled: the prebuilt one loads
    assert cpu_decode._load().paged_decode is not None
    assert not (tmp_path / "cache").exists()
