"""Engine precision and compilation: fp32 stays the default; bf16 (on CPUs with native bf16)
gives the same first greedy tokens as fp32 on the tiny model; the fused q/k/v and gate/up
weights are the checkpoint's, under F.linear and oneDNN (CPU); `compile_decode` gives fp32's exact tokens or falls back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from triptych.cli import main
from triptych.sampling_params import SamplingParams
from triptych.worker.engine import Engine, EngineConfig, Request
from triptych.worker.models import compile as compile_mod
from triptych.worker.models import linear_kernels

PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 3, 77, 12, 9, 100], [300, 2, 2, 51], [11, 12, 13, 14, 15, 16, 17, 18]]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/worker/conftest.py


def _greedy(engine: Engine, n: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    reqs = engine.generate_batch([Request(f"r{i}", p, params) for i, p in enumerate(PROMPTS)])
    return [list(r.output_token_ids) for r in reqs]


def test_fp32_is_the_default(qwen2_vl_dir: Path) -> None:
    engine = Engine(EngineConfig(model=str(qwen2_vl_dir), num_kv_blocks=16))
    assert engine.config.dtype == "float32"
    assert engine.language.dtype == torch.float32 and engine.kv.tensor.dtype == torch.float32


def test_bf16_first_tokens_match_fp32(qwen2_vl_dir: Path) -> None:
    fp32 = Engine(EngineConfig(model=str(qwen2_vl_dir), num_kv_blocks=16))
    bf16 = Engine(EngineConfig(model=str(qwen2_vl_dir), num_kv_blocks=16, dtype="bfloat16"))
    assert bf16.language.dtype == torch.bfloat16 and bf16.kv.tensor.dtype == torch.bfloat16
    ref, low = _greedy(fp32, 2), _greedy(bf16, 2)
    assert [r[0] for r in low] == [r[0] for r in ref]
    # The LM head's logits: bf16's within a few bf16 roundings (2^-8 relative, summed over the
    # hidden size) of fp32's, measured against the logits' scale.
    ids = torch.tensor(PROMPTS[1])
    logits = {}
    for name, eng in (("fp32", fp32), ("bf16", bf16)):
        with torch.inference_mode():
            hidden = eng.language.embed(ids)
            logits[name] = eng.language.lm_head(eng.language.norm(hidden)).float()
    err = (logits["bf16"] - logits["fp32"]).abs().max()
    assert 0 < err <= 0.03 * logits["fp32"].abs().max()


def test_generate_cli_runs_in_bf16(capsys: pytest.CaptureFixture[str], qwen2_vl_dir: Path) -> None:
    assert main(["generate", "--model", str(qwen2_vl_dir), "--prompt", "hello there", "--max-tokens", "4",
                 "--dtype", "bfloat16"]) == 0
    assert capsys.readouterr().out.strip()


def test_fused_projections_are_the_checkpoint_weights(qwen2_vl_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(linear_kernels.ENV, "torch")
    engine = Engine(EngineConfig(model=str(qwen2_vl_dir), num_kv_blocks=16))
    attn, mlp = engine.language.layers[0].self_attn, engine.language.layers[0].mlp
    assert isinstance(attn._qkv, linear_kernels.TorchLinear)
    fused = attn._qkv.weight
    q, k = attn.q_proj.weight, attn.k_proj.weight
    assert torch.equal(fused[:q.shape[0]], q) and torch.equal(fused[q.shape[0]:q.shape[0] + k.shape[0]], k)
    # Views, not copies: a weight written through the checkpoint's name is the one the GEMM uses.
    assert q.data_ptr() == fused.data_ptr() and mlp.up_proj.weight.data_ptr() > mlp._gate_up.weight.data_ptr()
    x = torch.randn(3, attn.q_proj.in_features)
    with torch.inference_mode():
        gate, up = mlp._gate_up(x).split(mlp.gate_proj.out_features, dim=-1)
        assert torch.allclose(gate, x @ mlp.gate_proj.weight.T, atol=1e-5)
        assert torch.allclose(up, x @ mlp.up_proj.weight.T, atol=1e-5)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
def test_cpu_linears_run_on_onednn_over_the_checkpoint_weights(qwen2_vl_dir: Path) -> None:
    """On CPU every linear's GEMM is oneDNN over a reordered copy of its weight; the
    modules keep the checkpoint's tensors; the kernels compute what the checkpoint says."""
    from safetensors.torch import load_file

    engine = Engine(EngineConfig(model=str(qwen2_vl_dir), num_kv_blocks=16))
    lm = engine.language
    layer = lm.layers[0]
    kernels = [layer.self_attn._qkv, layer.self_attn._o, layer.mlp._gate_up, layer.mlp._down, lm._lm_head]
    assert all(isinstance(k, linear_kernels.OneDNNLinear) for k in kernels)
    ckpt = {}
    for f in sorted(qwen2_vl_dir.glob("*.safetensors")):
        ckpt.update(load_file(str(f)))
    prefix = next(key[:-len("layers.0.self_attn.q_proj.weight")] for key in ckpt
                  if key.endswith("layers.0.self_attn.q_proj.weight") and "visual" not in key)
    wq, bq = ckpt[prefix + "layers.0.self_attn.q_proj.weight"], ckpt[prefix + "layers.0.self_attn.q_proj.bias"]
    wd = ckpt[prefix + "layers.0.mlp.down_proj.weight"]
    x = torch.randn(5, lm.spec.hidden_size)
    with torch.inference_mode():
        q = layer.self_attn._qkv(x)[:, :wq.shape[0]]
        assert torch.allclose(q, x @ wq.T + bq, atol=1e-5)
        h = torch.randn(5, lm.spec.intermediate_size)
        assert torch.allclose(layer.mlp._down(h), h @ wd.T, atol=1e-5)
        assert torch.equal(layer.mlp.down_proj.weight, wd)


def test_compile_falls_back_to_eager_when_compiling_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(fn, **_kw):
        def run(*_a):
            raise RuntimeError("no C++ compiler")
        return run

    monkeypatch.setattr(torch, "compile", broken)
    kernel = compile_mod.GuardedCompile(torch.add)
    assert torch.equal(kernel(torch.ones(2), torch.ones(2)), torch.full((2,), 2.0)) and kernel.failed
    assert torch.equal(kernel(torch.ones(2), torch.zeros(2)), torch.ones(2))  # eager from now on


@pytest.mark.slow
def test_compiled_decode_gives_fp32_eager_tokens(qwen2_vl_dir: Path) -> None:
    eager = Engine(EngineConfig(model=str(qwen2_vl_dir), num_kv_blocks=16))
    compiled = Engine(EngineConfig(model=str(qwen2_vl_dir), num_kv_blocks=16, compile_decode=True))
    norm = compiled.language.norm.kernel
    assert isinstance(norm, compile_mod.GuardedCompile)
    assert _greedy(compiled, 6) == _greedy(eager, 6)
