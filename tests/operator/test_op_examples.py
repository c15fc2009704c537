"""Checked-in manifests: example custom resources against the CRD schema, deploy/ manifests
against Kubernetes' own schemas, and everything the examples render."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from triptych.kube import names
from triptych.operator.api import parse_spec
from triptych.operator.crd import CRD_PATH
from triptych.operator.desired import ClusterFacts, Owner, desired_objects

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
DEPLOY = sorted((ROOT / "deploy").glob("*.yaml"))
K8S_VERSION = "1.33"


def crd_validator() -> jsonschema.Draft4Validator:
    """The CRD's openAPIV3Schema as JSON Schema draft 4 (OpenAPI 3.0 is draft-4 based; its
    `nullable` becomes a null type, `x-kubernetes-*` markers are ignored)."""
    crd = yaml.safe_load(CRD_PATH.read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]

    def convert(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: convert(v) for k, v in node.items()}
            if out.pop("nullable", False):
                if "type" in out:
                    out["type"] = [out["type"], "null"]
                if "enum" in out:
                    out["enum"] = [*out["enum"], None]
            return out
        if isinstance(node, list):
            return [convert(v) for v in node]
        return node

    converted = convert(schema)
    jsonschema.Draft4Validator.check_schema(converted)
    return jsonschema.Draft4Validator(converted)


def load(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_examples_exist() -> None:
    assert {p.name for p in EXAMPLES} >= {"tiny-cpu.yaml", "qwen2-vl-7b-epd.yaml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_valid_against_the_crd_and_the_operator(path: Path) -> None:
    validator = crd_validator()
    (resource,) = load(path)
    assert resource["apiVersion"] == names.API_VERSION and resource["kind"] == names.KIND
    errors = sorted(validator.iter_errors(resource), key=str)
    assert errors == [], [f"{list(e.path)}: {e.message}" for e in errors]
    meta = resource["metadata"]
    spec = parse_spec(resource["spec"], name=meta["name"])  # the cross-field rules hold too
    desired = desired_objects(Owner(meta["name"], meta["namespace"], "00000000-0000-4000-8000-000000000000"), spec,
                        ClusterFacts(operator_namespace="triptych-system"))
    for obj in desired.objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_examples_say_what_the_issue_asks_for() -> None:
    tiny = parse_spec(load(ROOT / "examples" / "tiny-cpu.yaml")[0]["spec"], name="tiny")
    assert tiny.model.source.tiny == "qwen2-vl"
    assert not any(p.uses_gpu for p in tiny.effective_pools())
    gpu = parse_spec(load(ROOT / "examples" / "qwen2-vl-7b-epd.yaml")[0]["spec"], name="qwen2-vl-7b")
    assert {t.value: n for t, n in gpu.counts().items()} == {"E": 2, "P": 1, "D": 3}
    assert all(p.uses_gpu for p in gpu.effective_pools()) and gpu.model.family == "qwen2-vl"


@pytest.mark.parametrize(("path", "value"), [
    (("spec", "topology", "D"), -1),
    (("spec", "router", "serviceType"), "Ingress"),
    (("spec", "model", "dtype"), "int4"),
    (("spec", "pools", 0, "instanceTypes", 0), "X"),
    (("spec", "slo", "attainmentTarget"), 1.5),
    (("spec", "model"), None),
])
def test_crd_schema_rejects_bad_values(path: tuple[Any, ...], value: Any) -> None:
    resource = copy.deepcopy(load(ROOT / "examples" / "qwen2-vl-7b-epd.yaml")[0])
    node = resource
    for key in path[:-1]:
        node = node[key]
    if value is None:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    assert list(crd_validator().iter_errors(resource)), f"{path}={value!r} should be rejected"


@pytest.mark.parametrize("path", DEPLOY, ids=lambda p: p.name)
def test_deploy_manifests_validate_strictly(path: Path) -> None:
    for obj in load(path):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
