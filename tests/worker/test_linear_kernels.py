"""The oneDNN kernels built ahead (worker/models/linear_kernels.py `warm`): every kernel
run at each row count up to the engine's batch size, on the caller's thread, one count at
a time, stopping where a count's GEMMs get expensive."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from triptych.topology import InstanceType
from triptych.worker.engine import Engine, EngineConfig
from triptych.worker.models import linear_kernels
from triptych.worker.models.linear_kernels import OneDNNLinear, TorchLinear, linear_kernel, warm

onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(rows, in_features) of every oneDNN linear call."""
    monkeypatch.delenv(linear_kernels.ENV, raising=False)
    seen: list[tuple[int, int]] = []
    real = torch.ops.mkldnn._linear_pointwise

    def spy(x, packed, *args):
        seen.append((x.shape[0], x.shape[1]))
        return real(x, packed, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    return seen


@onednn
def test_warm_runs_each_onednn_kernel_at_every_row_count(calls: list[tuple[int, int]]) -> None:
    kernels = [linear_kernel(nn.Linear(16, 8)), linear_kernel(nn.Linear(8, 24))]
    assert all(isinstance(k, OneDNNLinear) for k in kernels) and kernels[0].in_features == 16
    sizes = warm(kernels, 5)
    assert calls == []  # nothing until asked
    assert next(sizes) == 1 and calls == [(1, 16), (1, 8)]  # one count per next(), every kernel
    assert list(sizes) == [2, 3, 4, 5]
    assert calls == [(r, k) for r in range(1, 6) for k in (16, 8)]


@onednn
def test_warm_stops_after_a_count_whose_gemms_are_slow(calls: list[tuple[int, int]],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear_kernels, "WARM_STOP_S", -1.0)  # every count is "slow"
    assert list(warm([linear_kernel(nn.Linear(16, 8))], 64)) == [1]
    assert calls == [(1, 16)]


@onednn
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])
def test_a_few_rows_over_a_large_weight_run_padded_and_give_the_same_answer(
        rows: int, calls: list[tuple[int, int]]) -> None:
    torch.manual_seed(rows)
    lin = nn.Linear(512, linear_kernels.PAD_BYTES // (512 * 4))  # a weight of PAD_BYTES
    kernel = linear_kernel(lin)
    x = torch.randn(rows, 512)
    out = kernel(x)
    assert out.shape == (rows, lin.out_features)
    assert calls == [(max(rows, linear_kernels.MIN_ROWS), 512)]
    assert torch.allclose(out, torch.nn.functional.linear(x, lin.weight, lin.bias), atol=1e-4, rtol=1e-5)


@onednn
def test_a_small_weight_runs_its_rows_as_they_are(calls: list[tuple[int, int]]) -> None:
    kernel = linear_kernel(nn.Linear(64, 64))
    assert kernel(torch.randn(1, 64)).shape == (1, 64)
    assert calls == [(1, 64)]


def test_warm_has_nothing_to_build_without_onednn_kernels() -> None:
    lin = nn.Linear(4, 4)
    assert list(warm([TorchLinear(lin.weight, lin.bias)], 64)) == []


@onednn
def test_an_engine_warms_its_language_models_shapes_up_to_its_batch_size(qwen2_vl_dir: Path,
                                                                         calls: list[tuple[int, int]]) -> None:
    engine = Engine(EngineConfig(model=str(qwen2_vl_dir), role=InstanceType.PD, num_kv_blocks=16, max_num_seqs=6))
    lm = engine.language
    layer = lm.layers[0]
    assert lm.gemm_kernels() == [layer.self_attn._qkv, layer.self_attn._o, layer.mlp._gate_up, layer.mlp._down,
                                 lm._lm_head]
    calls.clear()
    assert list(engine.warm_ups()) == [1, 2, 3, 4, 5, 6]
    hidden, inter = lm.spec.hidden_size, lm.spec.intermediate_size
    assert calls == [(r, k) for r in range(1, 7) for k in (hidden, hidden, hidden, inter, hidden)]
    encoder = Engine(EngineConfig(model=str(qwen2_vl_dir), role=InstanceType.E, num_mm_blocks=16))
    assert list(encoder.warm_ups()) == []  # no language model: nothing to build
