"""The Helm chart, with the real helm binary: lint --strict; template with the default values and
with every ci/ values file; every rendered object valid for Kubernetes 1.33 and the newest
version kubernetes-validate knows (custom resources against their CRD or schema excerpts,
alert rules with promtool); the chart's CRD identical to crds/ and to the generator; the RBAC
identical to deploy/operator-rbac.yaml plus kopf peering."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from installkit import find_helm

from triptych.operator.api import parse_spec
from triptych.operator.crd import render_crd

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "triptych"
VALUES_FILES = sorted((CHART / "ci").glob("*.yaml"))
K8S_VERSIONS = ("1.33", kubernetes_validate.latest_version())
BUILTIN = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "Deployment", "ConfigMap",
           "Service"}
PEERING_RESOURCES = {"kopfpeerings", "clusterkopfpeerings"}

HELM = find_helm()
needs_helm = pytest.mark.skipif(HELM is None, reason="needs helm: tools/install-test-deps.sh fetches it into "
                                                     "~/.cache/triptych/bin (or set TRIPTYCH_HELM)")

# Prometheus Operator kinds are CRDs kubernetes-validate has no schema for: the fields the
# chart sets are checked against these excerpts of their schemas.
_SELECTOR = {"type": "object", "additionalProperties": False, "properties": {
    "matchLabels": {"type": "object"},
    "matchExpressions": {"type": "array", "items": {
        "type": "object", "required": ["key", "operator"], "additionalProperties": False,
        "properties": {"key": {"type": "string"}, "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                       "values": {"type": "array", "items": {"type": "string"}}}}}}}
_NS_SELECTOR = {"type": "object", "additionalProperties": False, "properties": {
    "any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}}
_ENDPOINT = {"type": "object", "additionalProperties": False, "required": ["port"], "properties": {
    "port": {"type": "string"}, "path": {"type": "string"}, "honorLabels": {"type": "boolean"},
    "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"}}}
_META = {"type": "object", "required": ["name", "namespace"]}


def _monitor(kind: str, endpoints: str) -> dict[str, Any]:
    return {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": kind}, "metadata": _META,
        "spec": {"type": "object", "additionalProperties": False, "required": ["selector", endpoints],
                 "properties": {"selector": _SELECTOR, "namespaceSelector": _NS_SELECTOR,
                                endpoints: {"type": "array", "minItems": 1, "items": _ENDPOINT}}}}}


CUSTOM_SCHEMAS = {
    "ServiceMonitor": _monitor("ServiceMonitor", "endpoints"),
    "PodMonitor": _monitor("PodMonitor", "podMetricsEndpoints"),
    "PrometheusRule": {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "metadata": _META,
        "spec": {"type": "object", "additionalProperties": False, "required": ["groups"], "properties": {
            "groups": {"type": "array", "items": {"type": "object", "required": ["name", "rules"]}}}}}},
}


def helm(*args: str) -> str:
    assert HELM is not None
    out = subprocess.run([HELM, *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"helm {' '.join(args)}:\n{out.stdout}\n{out.stderr}"
    return out.stdout


def template(values: Path | None, *extra: str) -> list[dict[str, Any]]:
    args = ["template", "demo", str(CHART), "--namespace", "triptych-system", "--include-crds", *extra]
    if values is not None:
        args += ["-f", str(values)]
    return [d for d in yaml.safe_load_all(helm(*args)) if d]


def crd_schemas() -> dict[str, dict[str, Any]]:
    schemas = {}
    for path in sorted((CHART / "crds").glob("*.yaml")):
        for crd in yaml.safe_load_all(path.read_text()):
            schemas[crd["spec"]["names"]["kind"]] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schemas


def validate(obj: dict[str, Any], version: str, tmp_path: Path) -> None:
    kind = obj["kind"]
    if kind == "CustomResourceDefinition" or kind in BUILTIN:
        kubernetes_validate.validate(obj, version, strict=True)
    elif kind in CUSTOM_SCHEMAS:
        jsonschema.validate(obj, CUSTOM_SCHEMAS[kind])
        if kind == "PrometheusRule":
            check_rules_with_promtool(obj, tmp_path)
    elif kind in ("MLLMDeployment", "KopfPeering", "ClusterKopfPeering"):
        # OpenAPI v3.0 schemas: JSON Schema draft 4 semantics (DESIGN.md).
        jsonschema.Draft4Validator(crd_schemas()[kind]).validate(obj)
        if kind == "MLLMDeployment":
            parse_spec(obj["spec"], name=obj["metadata"]["name"])
    else:
        raise AssertionError(f"unexpected kind {kind}")


def check_rules_with_promtool(rule: dict[str, Any], tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        return  # the jsonschema excerpt still ran; tests/install/test_dashboards.py needs prometheus anyway
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@needs_helm
def test_lint_strict() -> None:
    helm("lint", "--strict", str(CHART))
    for values in VALUES_FILES:
        helm("lint", "--strict", str(CHART), "-f", str(values))


@needs_helm
@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("values", [None, *VALUES_FILES], ids=lambda v: "default" if v is None else v.stem)
def test_rendered_objects_validate(values: Path | None, version: str, tmp_path: Path) -> None:
    objects = template(values)
    kinds = {o["kind"] for o in objects}
    assert {"CustomResourceDefinition", "Deployment", "ServiceAccount"} <= kinds
    namespaced = values is not None and (yaml.safe_load(values.read_text()).get("rbac") or {}).get("scope") == "namespaced"
    if namespaced:  # least privilege: no cluster-scoped RBAC at all
        assert not kinds & {"ClusterRole", "ClusterRoleBinding"}, kinds
    else:
        assert "ClusterRole" in kinds
    for obj in objects:
        validate(obj, version, tmp_path)


@needs_helm
def test_every_optional_object_renders() -> None:
    kinds = {(o["kind"], o["metadata"].get("namespace")) for v in VALUES_FILES for o in template(v)}
    for kind in ("ServiceMonitor", "PodMonitor", "PrometheusRule", "MLLMDeployment", "Role", "RoleBinding",
                 "KopfPeering", "ClusterKopfPeering"):
        assert kind in {k for k, _ in kinds}, kind
    assert ("ConfigMap", "monitoring") in kinds  # dashboards.namespace


@needs_helm
def test_the_operator_serves_and_the_monitors_scrape_the_planner_metrics() -> None:
    """The dashboards' planner panel reads triptych_planner_*: the operator serves them
    (TRIPTYCH_PLANNER_ENDPOINT on operator.plannerPort) and the chart's monitors scrape that
    port; plannerPort 0 turns all of it off."""
    def operator_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
        dep = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "demo-triptych-operator")
        return dep["spec"]["template"]["spec"]["containers"][0]

    monitoring = CHART / "ci" / "monitoring-values.yaml"
    objects = template(monitoring)
    container = operator_container(objects)
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["TRIPTYCH_PLANNER_ENDPOINT"] == "0.0.0.0:8090"
    assert {"name": "planner", "containerPort": 8090, "protocol": "TCP"} in container["ports"]
    pod_labels = next(o for o in objects if o["kind"] == "Deployment")["spec"]["template"]["metadata"]["labels"]
    by_name = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    service = by_name[("Service", "demo-triptych-operator-planner")]
    assert service["spec"]["ports"][0]["targetPort"] == "planner"
    assert service["spec"]["selector"].items() <= pod_labels.items()
    monitor = by_name[("ServiceMonitor", "demo-triptych-operator")]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == "planner"
    pods = by_name[("PodMonitor", "demo-triptych-operator")]
    assert pods["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pods["spec"]["podMetricsEndpoints"][0]["port"] == "planner"
    # the router/worker monitors do not pick the operator's Service or pods up twice
    for kind in ("ServiceMonitor", "PodMonitor"):
        (expr,) = by_name[(kind, "demo-triptych")]["spec"]["selector"]["matchExpressions"][1:]
        assert "operator" not in expr["values"]

    off = template(monitoring, "--set", "operator.plannerPort=0")
    assert "TRIPTYCH_PLANNER_ENDPOINT" not in {e["name"] for e in operator_container(off)["env"]}
    assert not [o for o in off if o["metadata"]["name"].startswith("demo-triptych-operator") and
                o["kind"] in ("Service", "ServiceMonitor", "PodMonitor")]


def test_chart_crd_is_the_generated_crd() -> None:
    chart_crd = (CHART / "crds" / "mllmdeployment.yaml").read_text()
    assert chart_crd == (ROOT / "crds" / "mllmdeployment.yaml").read_text() == render_crd(), \
        "run: triptych crd --out crds/mllmdeployment.yaml && cp crds/mllmdeployment.yaml charts/triptych/crds/"


def _pairs(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def _deploy_operator_pairs() -> set[tuple[str, str, str]]:
    docs = yaml.safe_load_all((ROOT / "deploy" / "operator-rbac.yaml").read_text())
    return _pairs(next(d for d in docs if d and d["kind"] == "ClusterRole")["rules"])


def _operator_rules(objects: list[dict[str, Any]], kind: str) -> list[set[tuple[str, str, str]]]:
    return [_pairs(o["rules"]) for o in objects
            if o["kind"] == kind and o["metadata"]["name"].endswith("-operator")]


@needs_helm
@pytest.mark.parametrize("values", [None, *VALUES_FILES], ids=lambda v: "default" if v is None else v.stem)
def test_rbac_is_deploy_rbac_plus_peering(values: Path | None) -> None:
    """The chart grants what deploy/operator-rbac.yaml grants (which tests/operator/test_op_rbac.py
    derives from the operator's real requests), plus kopf peering exactly when it is enabled."""
    objects = template(values)
    config = yaml.safe_load(values.read_text()) if values else {}
    peering = config.get("operator", {}).get("peering", {}).get("enabled", False)
    namespaced = config.get("rbac", {}).get("scope") == "namespaced"
    kind, resource = ("Role", "kopfpeerings") if namespaced else ("ClusterRole", "clusterkopfpeerings")
    granted = _operator_rules(objects, kind)
    assert len(granted) == (len(config["rbac"]["watchNamespaces"]) if namespaced else 1)
    base = {p for p in _deploy_operator_pairs() if p[1] not in PEERING_RESOURCES}
    # operator/peering.py creates the peering object when it is missing: create, besides kopf's verbs.
    verbs = ("get", "list", "watch", "create", "patch")
    expected = base | ({("kopf.dev", resource, v) for v in verbs} if peering else set())
    for pairs in granted:
        assert pairs == expected
    # Each router gets a Role from the operator (per deployment): the chart grants none itself.
    assert not [o for o in objects if o["kind"] == "ClusterRole" and o["metadata"]["name"] == "triptych-router"]


@needs_helm
def test_operator_args_follow_scope_and_peering() -> None:
    def args(values: Path | None) -> list[str]:
        dep = next(o for o in template(values) if o["kind"] == "Deployment")
        return dep["spec"]["template"]["spec"]["containers"][0]["args"]

    assert args(None) == ["operator", "--standalone"]
    assert args(CHART / "ci" / "namespaced-peering-values.yaml") == [
        "operator", "--peering=default", "--namespace=team-a", "--namespace=team-b"]


@needs_helm
@pytest.mark.parametrize("bad, message", [
    (["--set", "operator.replicas=2"], "needs operator.peering.enabled"),
    (["--set", "rbac.scope=namespaced"], "needs rbac.watchNamespaces"),
    (["--set", "rbac.scope=everywhere"], "rbac.scope"),
    (["--set", "unknownKey=1"], "unknownKey"),
    (["--set", "monitoring.prometheusRule.sloAttainmentTarget=2"], "sloAttainmentTarget"),
])
def test_bad_values_are_refused(bad: list[str], message: str) -> None:
    assert HELM is not None
    out = subprocess.run([HELM, "template", "demo", str(CHART), *bad], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and message in out.stderr, out.stderr


def _leaves(values: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Paths of values.yaml keys the schema does not describe."""
    missing = [] if "description" in schema or not path else [path]
    if isinstance(values, dict) and "properties" in schema:
        for key, sub in values.items():
            if key not in schema["properties"]:
                missing.append(f"{path}.{key}")
            else:
                missing += _leaves(sub, schema["properties"][key], f"{path}.{key}")
    return missing


def test_values_schema_documents_every_value() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert _leaves(values, schema) == []
    jsonschema.validate(values, schema)
    # The default example is the repository's tiny CPU example.
    example = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
    assert values["example"]["spec"] == example["spec"]


def test_dashboards_in_chart_carry_the_sidecar_label() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["monitoring"]["dashboards"]["labels"] == {"grafana_dashboard": "1"}
    assert sorted(p.name for p in (CHART / "dashboards").glob("*.json")) == \
        sorted(p.name for p in (ROOT / "deploy" / "dashboards").glob("*.json"))
