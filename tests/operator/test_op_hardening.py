"""Hardening of the rendered objects and of the spec's opaque fields (issue 8, Kubernetes part):
tokens from a Secret, probes and shutdown, least privilege, auth on by default. Pure."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from test_op_reconcile import FACTS, LAYOUTS, OWNER, render, tiny, validate_offline

from triptych.kube import names
from triptych.operator.api import InvalidSpecError, parse_spec
from triptych.operator.desired import ClusterFacts, desired_objects


def pod_specs(layout: str) -> dict[str, dict[str, Any]]:
    return {name: dep["spec"]["template"]["spec"] for name, dep in render(LAYOUTS[layout][0]).by_kind(
        "Deployment").items()}


def walk(obj: Any) -> list[Any]:
    """Every dict and list nested in obj."""
    out = [obj]
    children = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list) else []
    for child in children:
        out += walk(child)
    return out


def problems(spec: dict[str, Any]) -> list[str]:
    with pytest.raises(InvalidSpecError) as e:
        parse_spec(spec, name="demo")
    return e.value.problems


# --- tokens ------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_tokens_come_from_the_deployment_secret_never_from_args(layout: str) -> None:
    secret = names.tokens_secret_name("demo")
    want = {"worker": {names.ENV_INTERNAL_TOKEN: names.SECRET_KEY_INTERNAL_TOKEN,
                       names.ENV_ADMIN_TOKEN: names.SECRET_KEY_ADMIN_TOKEN},
            "router": {names.ENV_INTERNAL_TOKEN: names.SECRET_KEY_INTERNAL_TOKEN,
                       names.ENV_ADMIN_TOKEN: names.SECRET_KEY_ADMIN_TOKEN}}
    for pod in pod_specs(layout).values():
        (container,) = pod["containers"]
        env = {e["name"]: e for e in container["env"]}
        for var, key in want[container["name"]].items():
            assert env[var] == {"name": var, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}
        assert not any("token" in a.lower() for a in container["args"])
        assert all("value" not in e for e in container["env"] if "TOKEN" in e["name"])


def test_the_crd_has_no_token_field() -> None:
    from triptych.operator.crd import render_crd

    schema = str(render_crd()).lower()
    assert "token\"" not in schema and "internaltoken" not in schema and "admintoken" not in schema


# --- probes and shutdown -------------------------------------------------------------------

def test_worker_liveness_is_live_and_grace_covers_the_drain() -> None:
    pod = pod_specs("E+P+D-gpu")["demo-gpu"]
    (c,) = pod["containers"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/live"
    assert c["startupProbe"]["httpGet"]["path"] == "/live"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["lifecycle"] == {"preStop": {"sleep": {"seconds": names.PRESTOP_SLEEP_S}}}
    assert pod["terminationGracePeriodSeconds"] >= (names.PRESTOP_SLEEP_S + names.WORKER_DRAIN_TIMEOUT_S
                                                    + names.GRACE_MARGIN_S)
    assert names.GRACE_MARGIN_S >= 10


def test_worker_drain_timeout_matches_the_worker_default() -> None:
    from triptych.worker.settings import WorkerSettings

    assert WorkerSettings.model_fields["drain_timeout_s"].default <= names.WORKER_DRAIN_TIMEOUT_S


# --- least privilege -----------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_empty_dir_has_a_size_limit(layout: str) -> None:
    for pod in pod_specs(layout).values():
        for volume in pod["volumes"]:
            if "emptyDir" in volume:
                assert volume["emptyDir"].get("sizeLimit"), volume


@pytest.mark.parametrize("layout", LAYOUTS)
def test_disruption_budgets_never_block_a_drain(layout: str) -> None:
    for pdb in render(LAYOUTS[layout][0]).by_kind("PodDisruptionBudget").values():
        assert pdb["spec"]["maxUnavailable"] >= 1
        assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert any("maxUnavailable" in p for p in problems(tiny({"EPD": 1}, pools=[{"name": "w", "maxUnavailable": 0}])))


@pytest.mark.parametrize("facts", [FACTS, ClusterFacts(service_monitor_crd=True)])
def test_network_policy_has_no_empty_namespace_selector_and_limits_egress(facts: ClusterFacts) -> None:
    desired = desired_objects(OWNER, parse_spec(LAYOUTS["EP+D-two-pools"][0], name="demo"), facts)
    policy = desired.by_kind("NetworkPolicy")["demo-workers"]
    assert all(node.get("namespaceSelector") != {} for node in walk(policy) if isinstance(node, dict))
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    workers = {"podSelector": {"matchLabels": {names.LABEL_INSTANCE: "demo", names.LABEL_COMPONENT: "worker"}}}
    assert spec["egress"] == [{"to": [workers]},
                              {"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]}]
    operator_peers = [p for rule in spec["ingress"] for p in rule["from"]
                      if p.get("podSelector") == {"matchLabels": {names.LABEL_NAME: names.OPERATOR_NAME}}]
    assert len(operator_peers) == (1 if facts.operator_namespace else 0)
    validate_offline(policy, "1.33")


def test_scrapers_reach_the_metrics_port_only_with_monitoring_on() -> None:
    scraper = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "obs"}},
               "podSelector": {"matchLabels": {"app": "vm"}}}
    http = [{"port": names.PORT_NAME, "protocol": "TCP"}]
    on = render(tiny({"EPD": 1}, monitoring={"scrapers": [scraper]})).by_kind("NetworkPolicy")["demo-workers"]
    assert {"from": [scraper], "ports": http} in on["spec"]["ingress"]
    off = render(tiny({"EPD": 1}, monitoring={"serviceMonitor": False, "scrapers": [scraper]}))
    assert all(scraper not in rule["from"] for rule in off.by_kind("NetworkPolicy")["demo-workers"]["spec"]["ingress"])
    egress = {"ipBlock": {"cidr": "10.0.0.0/8"}}
    extra = render(tiny({"EPD": 1}, networkPolicy={"additionalEgress": [egress]}))
    assert {"to": [egress]} in extra.by_kind("NetworkPolicy")["demo-workers"]["spec"]["egress"]


@pytest.mark.parametrize("field", ["additionalIngress", "additionalEgress"])
def test_an_empty_namespace_selector_in_a_peer_is_invalid(field: str) -> None:
    spec = tiny({"EPD": 1}, networkPolicy={field: [{"namespaceSelector": {}}]})
    assert any("every namespace" in p and field in p for p in problems(spec))
    scrape = tiny({"EPD": 1}, monitoring={"scrapers": [{"namespaceSelector": {}, "podSelector": {}}]})
    assert any("every namespace" in p for p in problems(scrape))


@pytest.mark.parametrize("volume", [
    {"name": "host", "hostPath": {"path": "/var/run"}},
    {"name": "nfs", "nfs": {"server": "evil", "path": "/"}},
    {"name": "iscsi", "iscsi": {"targetPortal": "x", "iqn": "y", "lun": 0}},
    {"name": "scratch", "emptyDir": {}},  # no sizeLimit
])
def test_node_level_and_unbounded_volumes_are_refused(volume: dict[str, Any]) -> None:
    spec = tiny({"EPD": 1}, pools=[{"name": "w", "volumes": [volume]}])
    assert any(f"volumes[{volume['name']}]" in p for p in problems(spec)), problems(spec)


def test_model_volume_is_held_to_the_same_allow_list() -> None:
    spec = {"model": {"source": {"volume": {"hostPath": {"path": "/models"}}, "path": "m"}}, "topology": {"EPD": 1}}
    assert any("spec.model.source.volume" in p and "hostPath" in p for p in problems(spec))


def test_allowed_volume_types_render_and_validate() -> None:
    volumes = [{"name": "a", "configMap": {"name": "c"}}, {"name": "b", "secret": {"secretName": "s"}},
               {"name": "c", "emptyDir": {"sizeLimit": "1Gi"}},
               {"name": "d", "persistentVolumeClaim": {"claimName": "p"}},
               {"name": "e", "projected": {"sources": []}}, {"name": "f", "downwardAPI": {"items": []}},
               {"name": "g", "csi": {"driver": "x"}}]
    desired = render(tiny({"EPD": 1}, pools=[{"name": "w", "volumes": volumes}]))
    validate_offline(desired.by_kind("Deployment")["demo-w"], "1.33")


# --- auth on by default --------------------------------------------------------------------

@pytest.mark.parametrize("service_type", ["NodePort", "LoadBalancer"])
def test_an_exposed_router_needs_api_keys_unless_opted_out(service_type: str) -> None:
    spec = tiny({"EPD": 1}, router={"serviceType": service_type})
    assert any("apiKeysSecretRef" in p for p in problems(spec))
    opted_out = copy.deepcopy(spec)
    opted_out["router"]["allowUnauthenticated"] = True
    parse_spec(opted_out, name="demo")
    keyed = tiny({"EPD": 1}, router={"serviceType": service_type, "apiKeysSecretRef": {"name": "keys"}})
    parse_spec(keyed, name="demo")
    parse_spec(tiny({"EPD": 1}, router={"serviceType": "ClusterIP"}), name="demo")


# --- offline validation of the rendered children -------------------------------------------

def test_offline_validation_names_the_object_and_the_field() -> None:
    from triptych.operator.validation import invalid_objects

    desired = render(tiny({"EPD": 1}, pools=[{"name": "w", "affinity": {"podAntiAffinity": {"bogus": []}}}]))
    assert invalid_objects(render(LAYOUTS["E+P+D-gpu"][0]).objects) == []
    (problem,) = invalid_objects(desired.objects)
    assert problem.startswith("Deployment demo-w: spec.template.spec.affinity.podAntiAffinity") and "bogus" in problem
    assert invalid_objects(desired.objects) == [problem]  # cached by content hash: same answer
    broken = copy.deepcopy(desired.by_kind("Deployment")["demo-w"])
    broken["metadata"]["annotations"].pop(names.ANNOTATION_SPEC_HASH)  # uncached path
    assert invalid_objects([broken]) == [problem]
