"""Drift of child objects: the pure comparison, and the timer undoing hand edits (kmock)."""

from __future__ import annotations

import copy
from decimal import Decimal

import pytest
from kube_harness import APPLY, Env, sender, wait_for
from test_op_integration import settle, spec
from test_op_reconcile import LAYOUTS, render

from triptych.kube import names
from triptych.operator.drift import differences, quantity

pytestmark = pytest.mark.timeout(90)


def test_quantities_compare_by_value() -> None:
    assert quantity("1Gi") == quantity("1024Mi") == Decimal(2**30)
    assert quantity("500m") == quantity("0.5") == Decimal("0.5")
    assert quantity(2) == quantity("2") and quantity("1e3") == quantity("1k")
    assert quantity("http") is None and quantity("") is None


def test_what_the_api_server_adds_or_rewrites_is_not_drift() -> None:
    want = render(LAYOUTS["E+P+D-gpu"][0]).by_kind("Deployment")["demo-gpu"]
    live = copy.deepcopy(want)
    pod = live["spec"]["template"]["spec"]
    (worker,) = pod["containers"]
    worker["resources"]["requests"]["memory"] = "65536Mi"  # canonicalised differently
    worker["terminationMessagePath"] = "/dev/termination-log"  # defaults
    worker["env"].append({"name": "INJECTED", "value": "by a webhook"})  # another manager's item
    worker["env"][0]["valueFrom"]["fieldRef"]["apiVersion"] = "v1"
    pod["dnsPolicy"] = "ClusterFirst"
    live["metadata"]["labels"]["team"] = "vision"
    live["status"] = {"readyReplicas": 6}
    assert differences(want, live) == []


def test_hand_edits_are_drift_with_their_paths() -> None:
    want = render(LAYOUTS["E+P+D-gpu"][0]).by_kind("Deployment")["demo-gpu"]
    live = copy.deepcopy(want)
    live["spec"]["replicas"] = 9
    (worker,) = live["spec"]["template"]["spec"]["containers"]
    worker["image"] = "evil:latest"
    worker["resources"]["limits"]["memory"] = "1Gi"
    worker["args"].append("--debug")  # atomic list: an extra item is drift
    del live["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"]
    assert differences(want, live) == [
        "spec.replicas",
        "spec.template.spec.securityContext.runAsNonRoot",
        "spec.template.spec.containers[worker].image",
        "spec.template.spec.containers[worker].args",
        "spec.template.spec.containers[worker].resources.limits.memory",
    ]
    policy = render(LAYOUTS["E+P+D-gpu"][0]).by_kind("NetworkPolicy")["demo-workers"]
    opened = copy.deepcopy(policy)
    opened["spec"]["ingress"].append({"from": [{"namespaceSelector": {}}]})
    assert differences(policy, opened) == ["spec.ingress"]
    assert differences(policy, {**policy, "spec": "x"}) == ["spec"]


async def test_the_timer_undoes_hand_edits_of_children(env: Env) -> None:
    op = env.start_operator()
    await env.cluster.create_mllm("demo", spec(env.cluster.worker_port, {"E": 1, "P": 1, "D": 1}))
    await settle(env, "demo", 3)
    policy = env.api.get("networking.k8s.io/v1/networkpolicies", "demo-workers")["spec"]
    workers = env.api.get("apps/v1/deployments", "demo-cpu")["spec"]
    mark = env.mark()

    base = "/apis/networking.k8s.io/v1/namespaces/serving/networkpolicies/demo-workers"
    await env.cluster.request("PATCH", base, {"spec": {"ingress": [{"from": [{"namespaceSelector": {}}]}]}},
                              "application/merge-patch+json")  # opened to every namespace
    edit = copy.deepcopy(workers)
    edit["template"]["spec"]["containers"][0]["image"] = "someone/else:latest"
    edit["replicas"] = 7
    await env.cluster.request("PATCH", "/apis/apps/v1/namespaces/serving/deployments/demo-cpu",
                              {"spec": edit}, "application/merge-patch+json")

    await wait_for(lambda: env.api.get("networking.k8s.io/v1/networkpolicies", "demo-workers")["spec"] == policy
                   and env.api.get("apps/v1/deployments", "demo-cpu")["spec"] == workers,
                   what="children restored by the timer")
    repairs = [r for r in env.writes(mark) if sender(r) and r.resource is not None
               and r.resource.plural in ("networkpolicies", "deployments")]
    assert sorted((r.resource.plural, r.name) for r in repairs) == [("deployments", "demo-cpu"),
                                                                    ("networkpolicies", "demo-workers")]
    assert all(r.headers["Content-Type"] == APPLY and r.params["fieldManager"] == names.FIELD_MANAGER
               for r in repairs)
    # one event per pass that found drift (the two edits may land in different timer passes)
    events = await wait_for(lambda: " ".join(m for _, reason, m in op.events if reason == "DriftCorrected"),
                            what="DriftCorrected event")
    assert "NetworkPolicy demo-workers (spec.ingress)" in events and "Deployment demo-cpu (spec.replicas" in events
