"""The CRD: generated from the pydantic models, checked in, structural, and valid for Kubernetes."""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from triptych.cli import FAMILIES
from triptych.kube import names
from triptych.operator.api import Family, InvalidSpecError, MLLMDeploymentSpec, parse_spec
from triptych.operator.crd import (
    CRD_PATH,
    build_crd,
    cli_main,
    openapi_schema,
    render_crd,
    structural_problems,
    to_structural,
)
from triptych.topology import STAGE_TYPES, InstanceType

K8S_VERSIONS = ("1.33", kubernetes_validate.latest_version())


def test_checked_in_crd_is_up_to_date() -> None:
    assert CRD_PATH.read_text() == render_crd(), "run: triptych crd --out crds/mllmdeployment.yaml"


def test_cli_writes_the_crd(tmp_path: Path) -> None:
    out = tmp_path / "crd.yaml"
    assert cli_main(argparse.Namespace(out=str(out))) == 0
    assert yaml.safe_load(out.read_text()) == build_crd()


def test_schema_is_structural() -> None:
    schema = openapi_schema()
    assert structural_problems(schema) == []
    text = yaml.safe_dump(schema)
    for forbidden in ("$ref", "$defs", "propertyNames", "title:", "type: 'null'"):
        assert forbidden not in text


@pytest.mark.parametrize("broken", [
    {"type": "object", "properties": {"a": {"$ref": "#/x"}}},
    {"type": "object", "properties": {"a": {"description": "no type"}}},
    {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": {"type": "string"}},
    {"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}, {"type": "null"}]}}},
    {"type": "number", "exclusiveMinimum": 0},
])
def test_structural_check_catches_violations(broken: dict[str, Any]) -> None:
    assert structural_problems(broken) != []


def test_converter_rules() -> None:
    spec = openapi_schema()["properties"]["spec"]
    topology = spec["properties"]["topology"]
    assert set(topology["properties"]) == {t.value for t in InstanceType}  # enum-keyed map -> properties
    assert topology["properties"]["E"] == {"type": "integer", "minimum": 0}
    assert topology["minProperties"] == 1 and "additionalProperties" not in topology
    assert spec["required"] == ["model", "topology"]
    source = spec["properties"]["model"]["properties"]["source"]
    assert source["properties"]["pvc"]["nullable"] is True
    assert source["properties"]["volume"]["x-kubernetes-preserve-unknown-fields"] is True
    assert "x-kubernetes-validations" in source
    pool = spec["properties"]["pools"]["items"]
    assert spec["properties"]["pools"]["x-kubernetes-list-map-keys"] == ["name"]
    assert pool["properties"]["shmSize"]["x-kubernetes-int-or-string"] is True
    assert pool["properties"]["port"] == {"default": 8100, "maximum": 65535, "minimum": 1, "type": "integer"}
    assert set(pool["properties"]["instanceTypes"]["items"]["enum"]) == {t.value for t in InstanceType}
    target = spec["properties"]["slo"]["properties"]["attainmentTarget"]
    assert target["minimum"] == 0 and target["exclusiveMinimum"] is True and target["maximum"] == 1
    assert spec["properties"]["router"]["properties"]["serviceType"]["enum"] == ["ClusterIP", "NodePort",
                                                                                 "LoadBalancer"]


def test_converter_refuses_what_it_cannot_express() -> None:
    with pytest.raises(ValueError, match="anyOf"):
        to_structural({"anyOf": [{"type": "string"}, {"type": "integer"}]})


def test_status_subresource_and_printer_columns() -> None:
    version = build_crd()["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns == {"Topology": ".status.topology", "Instances": ".status.instances",
                       "Ready": '.status.conditions[?(@.type=="Ready")].status',
                       "Age": ".metadata.creationTimestamp"}
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert {"observedGeneration", "conditions", "instanceTypes", "workers", "topology", "instances"} <= set(status)
    cond_type = status["conditions"]["items"]["properties"]["type"]
    assert cond_type["enum"] == ["Ready", "Progressing", "Degraded"]
    assert build_crd()["spec"]["names"]["shortNames"] == ["mllm"]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_crd_validates_as_a_kubernetes_object(version: str) -> None:
    kubernetes_validate.validate(yaml.safe_load(CRD_PATH.read_text()), version, strict=True)


def test_family_names_match_the_cli() -> None:
    assert Family.__args__ == FAMILIES


# --- validation: schema-level and cross-field ----------------------------------------------

BASE = {"model": {"source": {"tiny": "qwen2-vl"}}, "topology": {"E": 1, "P": 1, "D": 1}}


def with_(**changes: Any) -> dict[str, Any]:
    spec = copy.deepcopy(BASE)
    spec.update(changes)
    return spec


def test_defaults() -> None:
    spec = parse_spec(BASE, name="demo")
    (pool,) = spec.effective_pools()
    assert pool.name == "workers" and set(pool.instance_types) == set(STAGE_TYPES)
    assert pool.image == names.DEFAULT_IMAGE and pool.port == names.WORKER_PORT
    assert spec.router.replicas == 1 and spec.transfer.backend == "nixl"
    assert spec.slo.attainment_target == 0.9 and spec.scheduling.budgets == "FromSLO"
    assert not spec.autoscaling.enabled


@pytest.mark.parametrize(("spec", "message"), [
    (with_(topology={"E": 1, "P": 1, "D": 1}, pools=[{"name": "a", "instanceTypes": ["E", "P"]}]),
     "no pool allows instance type D"),
    (with_(topology={"E": 1, "P": 1}), "no instance for stage(s): decode"),
    (with_(topology={"E": 0, "P": 0, "D": 0}), "no instances"),
    (with_(pools=[{"name": "a"}, {"name": "a"}]), "duplicate pool name"),
    (with_(scheduling={"budgets": "Fixed", "tokenBudget": 512}), "needs tokenBudget and imageBudget"),
    (with_(autoscaling={"limits": {"P": {"min": 3, "max": 2}}}), "min 3 > max 2"),
    (with_(autoscaling={"enabled": True}), "needs prometheusUrl"),
    (with_(autoscaling={"enabled": True, "prometheusUrl": "http://prom:9090",
                        "limits": {"D": {"min": 2, "max": 4}}}), "outside autoscaling limits"),
    (with_(pools=[{"name": "g", "resources": {"requests": {"nvidia.com/gpu": 1}}}]), "requests must equal limits"),
    (with_(model={"source": {"pvc": "m", "tiny": "llava", "path": "x"}}), "at most one of pvc, volume, tiny"),
    (with_(model={"source": {"path": "relative/dir"}}), "path must be absolute"),
    (with_(model={"source": {"pvc": "models"}}), "path is required"),
    (with_(topology={"X": 1}), "spec.topology.X"),
    (with_(pools=[{"name": "a", "port": 70000}]), "spec.pools[0].port"),
    (with_(pools=[{"name": "Bad_Name"}]), "spec.pools[0].name"),
    (with_(router={"serviceType": "Ingress"}), "spec.router.serviceType"),
    (with_(slo={"attainmentTarget": 0}), "spec.slo.attainmentTarget"),
    (with_(typo=1), "spec.typo"),
])
def test_invalid_specs_have_readable_messages(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidSpecError) as info:
        parse_spec(spec, name="demo")
    assert message in str(info.value)


def test_names_too_long_for_services() -> None:
    with pytest.raises(InvalidSpecError, match="DNS label"):
        parse_spec(BASE, name="x" * 60)
    with pytest.raises(InvalidSpecError, match="DNS label"):
        parse_spec(BASE, name="1abc")


def test_camel_case_round_trip() -> None:
    spec = MLLMDeploymentSpec.model_validate(with_(router={"apiKeysSecretRef": {"name": "keys"}}))
    dumped = spec.model_dump(by_alias=True, exclude_none=True)
    assert dumped["router"]["apiKeysSecretRef"] == {"name": "keys", "key": "api-keys"}
    assert MLLMDeploymentSpec.model_validate(dumped) == spec
