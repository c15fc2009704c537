"""RBAC derived from behaviour: the operator's ClusterRole grants exactly what its requests need.

One scenario walks every code path that talks to the API (create, role assignment, re-apply
of every child kind, scale-down, pruning, an invalid spec, deletion); the (group, resource,
verb) set of the requests it made must equal the ClusterRole's grants.
"""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml
from kube_harness import DEPLOY, NS, Env, iter_requests, operator_grants, rbac_grants, rbac_needs, wait_for
from test_op_integration import settle, spec

from triptych.cli import build_parser
from triptych.kube import names
from triptych.operator.peering import CLUSTER_PEERING, NAMESPACED_PEERING

pytestmark = pytest.mark.timeout(120)
PEERING = "triptych-operator"
CRDS = DEPLOY.parent / "crds"
CHILDREN = ("v1/configmaps", "v1/services", "v1/serviceaccounts", "apps/v1/deployments",
            "policy/v1/poddisruptionbudgets", "networking.k8s.io/v1/networkpolicies",
            "rbac.authorization.k8s.io/v1/roles", "rbac.authorization.k8s.io/v1/rolebindings",
            "monitoring.coreos.com/v1/servicemonitors")


def tamper_children(env: Env) -> None:
    """Make every child look out of date (as after an operator upgrade) without a watch event."""
    import kmock

    for res in CHILDREN:
        for name in env.api.all(res):
            env.api.objects[kmock.resource(res), NS, name].patch(
                {"metadata": {"annotations": {names.ANNOTATION_SPEC_HASH: "stale"}}})


async def walk_every_path(env: Env, namespaces: list[str] | None = None) -> None:
    """Drive the operator through every code path that talks to the API."""
    port = env.cluster.worker_port
    pools = [{"name": "enc", "instanceTypes": ["E"], "port": port},
             {"name": "llm", "instanceTypes": ["P", "D"], "port": port}]
    await env.start_operator(namespaces, peering=PEERING).ready()  # as deploy/operator.yaml runs it
    await env.cluster.create_mllm("demo", spec(port, {"E": 1, "P": 1, "D": 2}, pools=pools))
    await settle(env, "demo", 4)

    tamper_children(env)  # -> server-side apply patches of every existing child kind
    await wait_for(lambda: all(
        (obj["metadata"].get("annotations") or {}).get(names.ANNOTATION_SPEC_HASH) != "stale"
        for res in CHILDREN for obj in env.api.all(res).values()), what="children re-applied")

    await env.cluster.patch_mllm("demo", {"spec": {"topology": {"D": 1}}})  # deletion costs
    await wait_for(lambda: env.api.get("apps/v1/deployments", "demo-llm")["spec"]["replicas"] == 2,
                   what="scale down")
    await env.cluster.reconcile_replicas()

    await env.cluster.patch_mllm("demo", {"spec": {  # prune a pool, the monitor and the policy
        "pools": [{"name": "all", "port": port}], "monitoring": {"serviceMonitor": False},
        "networkPolicy": {"enabled": False}}})
    await wait_for(lambda: env.api.get("apps/v1/deployments", "demo-enc") is None, what="pool pruned")
    await wait_for(lambda: env.api.get("monitoring.coreos.com/v1/servicemonitors", "demo") is None,
                   what="monitor pruned")

    await env.cluster.patch_mllm("demo", {"spec": {"topology": {"X": 1}}})  # invalid: event
    await wait_for(lambda: (env.cluster.condition("demo", "Ready") or {}).get("reason") == "InvalidSpec",
                   what="InvalidSpec")
    await env.cluster.delete_mllm("demo")
    await wait_for(lambda: env.cluster.mllm("demo") is None, what="deleted")


@pytest.mark.parametrize("service_monitors", [True])
async def test_operator_cluster_role_is_exactly_what_the_code_uses(env: Env) -> None:
    await walk_every_path(env)
    needs = rbac_needs(env.api)
    grants = operator_grants()
    assert needs - grants == set(), "requests the ClusterRole does not allow"
    assert grants - needs == set(), "grants no code path used"


@pytest.mark.parametrize("service_monitors", [True])
async def test_namespaced_mode_needs_only_a_role_in_the_served_namespace(env: Env) -> None:
    await walk_every_path(env, namespaces=[NS])
    docs = [d for d in yaml.safe_load_all((DEPLOY / "operator-rbac-namespaced.yaml").read_text()) if d]
    assert {d["kind"] for d in docs} == {"ServiceAccount", "Role", "RoleBinding"}  # nothing cluster-scoped
    role = next(d for d in docs if d["kind"] == "Role")
    binding = next(d for d in docs if d["kind"] == "RoleBinding")
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == NS
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    needs = rbac_needs(env.api)
    grants = rbac_grants(role["rules"])
    assert needs - grants == set(), "requests the Role does not allow"
    assert grants - needs == set(), "grants no code path used"
    resource_requests = [r for r in iter_requests(env.api) if r.resource is not None and r.resource.plural]
    assert resource_requests and all(r.namespace == NS for r in resource_requests), "a cluster-scoped request"
    rendered = [o for res in CHILDREN for o in env.api.all(res).values()]
    assert rendered and not any(o["kind"].startswith("Cluster") for o in rendered)


def test_operator_rbac_binds_the_operator_service_account() -> None:
    docs = [d for d in yaml.safe_load_all((DEPLOY / "operator-rbac.yaml").read_text()) if d]
    binding = next(d for d in docs if d["kind"] == "ClusterRoleBinding")
    account = next(d for d in docs if d["kind"] == "ServiceAccount")
    assert binding["roleRef"]["name"] == "triptych-operator"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": account["metadata"]["namespace"]}]
    operator = [d for d in yaml.safe_load_all((DEPLOY / "operator.yaml").read_text()) if d]
    deployment = next(d for d in operator if d["kind"] == "Deployment")
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == account["metadata"]["name"]


def test_deploy_runs_two_peered_replicas_with_the_peering_crds() -> None:
    operator = [d for d in yaml.safe_load_all((DEPLOY / "operator.yaml").read_text()) if d]
    deployment = next(d for d in operator if d["kind"] == "Deployment")
    assert deployment["spec"]["replicas"] == 2
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = build_parser().parse_args(container["command"][1:])
    assert (args.command, args.peering, args.standalone) == ("operator", PEERING, False)
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"  # kopf's peer identity
    # the planner's metrics and /plan (operator/planner/k8s_daemon.py), on a named port
    assert env["TRIPTYCH_PLANNER_ENDPOINT"]["value"] == "0.0.0.0:8090"
    assert {"name": "planner", "containerPort": 8090, "protocol": "TCP"} in container["ports"]

    crds = {d["spec"]["names"]["plural"]: d for d in yaml.safe_load_all((CRDS / "kopf-peering.yaml").read_text())}
    for kind, scope in ((CLUSTER_PEERING, "Cluster"), (NAMESPACED_PEERING, "Namespaced")):
        crd = crds[kind.plural]
        assert (crd["spec"]["group"], crd["spec"]["names"]["kind"], crd["spec"]["scope"]) == (
            kind.group, kind.kind, scope)
        assert [v["name"] for v in crd["spec"]["versions"]] == [kind.api_version.rpartition("/")[2]]
        kubernetes_validate.validate(crd, "1.33", strict=True)
