"""Where the operator's replans get step times (spec.autoscaling.replanProfile): a ConfigMap's
measured profile, else the named GPU's roofline on the model's config.json; anything missing
or malformed is an error that says what and where."""

from __future__ import annotations

import json

import pytest

from triptych.operator.api import ReplanProfileSource
from triptych.operator.planner.k8s_profile import ProfileSourceError, profile_from
from triptych.operator.planner.model_shape import read_shape
from triptych.operator.planner.roofline import roofline_profile
from triptych.tiny_model import tiny_model_path

WHERE = "ConfigMap serving/prof"


@pytest.fixture(scope="module")
def config() -> str:
    return (tiny_model_path("qwen2-vl") / "config.json").read_text()


def test_a_measured_profile_wins_over_the_roofline(config: str) -> None:
    measured = roofline_profile(read_shape(tiny_model_path("qwen2-vl")), "A100").model_copy(
        update={"source": "measured:cpu"})
    data = {"profile.json": measured.model_dump_json(), "config.json": config}
    assert profile_from(data, ReplanProfileSource(config_map="prof", gpu="H100"), WHERE) == measured


def test_the_roofline_of_the_named_gpu_on_the_checkpoints_configs(config: str) -> None:
    model = tiny_model_path("qwen2-vl")
    data = {"config.json": config, "preprocessor_config.json": (model / "preprocessor_config.json").read_text()}
    got = profile_from(data, ReplanProfileSource(config_map="prof", gpu="L40S"), WHERE)
    assert got == roofline_profile(read_shape(model), "L40S")  # as `triptych plan --gpu` on the directory
    custom = ReplanProfileSource(config_map="prof", gpu="H100", config_key="model.json", profile_key="p")
    assert profile_from({"model.json": config}, custom, WHERE).source == "roofline:H100"  # patching defaults


@pytest.mark.parametrize("data, source, message", [
    ({}, {}, "has no key 'profile.json' (a measured profile), and no gpu is set"),
    ({}, {"gpu": "H100"}, "has neither 'profile.json' nor 'config.json'"),
    ({"profile.json": "{}"}, {}, "[profile.json] is not a step-time profile"),
    ({"config.json": "not json"}, {"gpu": "H100"}, "ConfigMap serving/prof: Expecting value"),
    ({"config.json": json.dumps({"model_type": "bert"})}, {"gpu": "H100"}, "model_type 'bert' is not one"),
    ({"config.json": json.dumps({"model_type": "qwen2_vl"})}, {"gpu": "H100"}, "not a complete qwen2_vl config"),
])
def test_what_is_missing_or_wrong_is_said(data: dict, source: dict, message: str) -> None:
    with pytest.raises(ProfileSourceError) as err:
        profile_from(data, ReplanProfileSource(config_map="prof", **source), WHERE)
    assert message in str(err.value)
