"""The worker reads the operator's serving config (TRIPTYCH_CONFIG): what the CRD says about
context length, block size and budgets reaches the engine."""

from __future__ import annotations

from pathlib import Path

import yaml

from triptych.operator.api import parse_spec
from triptych.operator.desired import pool_assignment, serving_config
from triptych.worker.settings import settings_from_serving_config

SPEC = {"model": {"source": {"tiny": "qwen2-vl"}, "maxModelLen": 1024}, "topology": {"EPD": 1}}


def _write(tmp_path: Path, spec: dict) -> str:
    parsed = parse_spec(spec, name="demo")
    path = tmp_path / "serving.yaml"
    path.write_text(yaml.safe_dump(serving_config(parsed, pool_assignment(parsed), "demo")))
    return str(path)


def test_slo_derived_budgets(tmp_path: Path) -> None:
    spec = {**SPEC, "slo": {"ttftMs": 800, "tbtMs": 50}}
    got = settings_from_serving_config(_write(tmp_path, spec))
    assert got["max_model_len"] == 1024 and got["block_size"] == 16
    assert (got["ttft_slo_s"], got["tbt_slo_s"]) == (0.8, 0.05)
    assert "token_budget" not in got


def test_fixed_budgets(tmp_path: Path) -> None:
    spec = {**SPEC, "scheduling": {"budgets": "Fixed", "tokenBudget": 256, "imageBudget": 4, "blockSize": 32}}
    got = settings_from_serving_config(_write(tmp_path, spec))
    assert (got["token_budget"], got["image_budget"], got["block_size"]) == (256, 4, 32)
    assert "ttft_slo_s" not in got


def test_parallel_vision_flag_reaches_the_settings() -> None:
    from triptych.cli import build_parser
    from triptych.worker.settings import settings_from_args

    base = ["worker", "--model", "m", "--config", ""]
    assert settings_from_args(build_parser().parse_args(base)).parallel_vision is True
    assert settings_from_args(build_parser().parse_args([*base, "--no-parallel-vision"])).parallel_vision is False
