"""Hardening end to end (issue 8, Kubernetes part): real kopf against kmock.

Tokens from the deployment's Secret on every /admin/role call, role drift after a worker
restart, pods assigned while their unassigned worker is not Ready, and specs the API server
or the security rules would refuse: InvalidSpec with nothing applied."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from kube_harness import Env, wait_for
from test_op_integration import children, settle, spec

from triptych.kube import names

pytestmark = pytest.mark.timeout(90)


def ready(env: Env, name: str) -> dict[str, Any]:
    return env.cluster.condition(name, "Ready") or {}


async def test_role_assignment_carries_the_admin_token_from_the_secret(env: Env) -> None:
    env.start_operator()
    await env.cluster.create_mllm("demo", spec(env.cluster.worker_port, {"E": 1, "P": 1, "D": 1}))
    await settle(env, "demo", 3)  # the fake workers answer 401 without the right token
    token = env.cluster.admin_token("demo")
    assert token and len(token) >= 32
    for worker in env.cluster.workers.values():
        assert worker.auth == [f"Bearer {token}"]
    secret = env.api.get("v1/secrets", "demo-tokens")
    await asyncio.sleep(1.2)  # timer passes never rewrite the tokens
    assert env.api.get("v1/secrets", "demo-tokens")["data"] == secret["data"]
    everything = json.dumps([env.cluster.mllm("demo"), *env.api.all("apps/v1/deployments").values(),
                             *env.cluster.pods().values()])
    assert token not in everything and env.cluster.admin_token("demo") == token


async def test_a_restarted_worker_is_reassigned_and_not_ready_meanwhile(env: Env) -> None:
    op = env.start_operator()
    await env.cluster.create_mllm("demo", spec(env.cluster.worker_port, {"E": 1, "P": 1, "D": 1}))
    await settle(env, "demo", 3)
    pod = next(n for n, p in env.cluster.pods().items() if p["metadata"]["labels"][names.LABEL_ROLE] == "D")
    worker = env.cluster.workers[pod]
    worker.role = "unassigned"  # the container restarted: unassigned again, the pod keeps its label
    worker.refuse = True  # ...and cannot take its role back yet

    cond = await wait_for(lambda: ready(env, "demo").get("status") == "False" and ready(env, "demo"),
                          what="Ready=False while the role is unsettled")
    assert cond["reason"] == "InstancesNotReady" and "D 0/1" in cond["message"]
    await wait_for(lambda: names.LABEL_ROLE not in env.cluster.pods()[pod]["metadata"]["labels"],
                   what="the stale label removed")
    assert names.LABEL_LLMD_ROLE not in env.cluster.pods()[pod]["metadata"]["labels"]
    assert any(r == "RoleDrift" and pod in m for _, r, m in op.events)

    worker.refuse = False
    await wait_for(lambda: worker.role == "D", what="re-assigned")
    await wait_for(lambda: ready(env, "demo").get("status") == "True", what="Ready again")
    labels = env.cluster.pods()[pod]["metadata"]["labels"]
    assert (labels[names.LABEL_ROLE], labels[names.LABEL_LLMD_ROLE]) == ("D", "decode")
    assert worker.calls[0] == "D" and worker.calls[-1] == "D"
    assert sorted(w.role for w in env.cluster.workers.values()) == ["D", "E", "P"]  # nobody else moved


async def test_unassigned_workers_that_are_not_ready_get_roles(env: Env) -> None:
    env.cluster.ready_follows_worker = True  # /ready is false for an unassigned worker
    env.start_operator()
    await env.cluster.create_mllm("demo", spec(env.cluster.worker_port, {"E": 1, "P": 1, "D": 1}))
    await wait_for(lambda: env.api.get("apps/v1/deployments", "demo-cpu"), what="worker deployment")
    await env.cluster.reconcile_replicas()
    await env.cluster.set_router_ready("demo")

    async def settled() -> bool:
        await env.cluster.sync_readiness()
        return ready(env, "demo").get("status") == "True"

    await wait_for(settled, what="roles assigned to not-Ready unassigned pods, then Ready")
    assert sorted(w.role for w in env.cluster.workers.values()) == ["D", "E", "P"]


async def invalid(env: Env, name: str, body: dict[str, Any]) -> dict[str, Any]:
    """Create `name`; wait for InvalidSpec; check that nothing at all was applied."""
    await env.cluster.create_mllm(name, body)
    cond = await wait_for(lambda: ready(env, name).get("reason") == "InvalidSpec" and ready(env, name),
                          what="InvalidSpec")
    await asyncio.sleep(1.2)  # timer passes: still nothing
    assert all(not objs for objs in children(env).values())
    assert env.api.all("v1/secrets") == {}
    assert env.cluster.pods() == {}
    return cond


async def test_host_path_volume_is_invalid_spec_with_nothing_applied(env: Env) -> None:
    op = env.start_operator()
    port = env.cluster.worker_port
    body = spec(port, pools=[{"name": "cpu", "port": port, "volumes": [{"name": "h", "hostPath": {"path": "/"}}],
                              "volumeMounts": [{"name": "h", "mountPath": "/host"}]}])
    cond = await invalid(env, "bad", body)
    assert "hostPath" in cond["message"] and "not allowed" in cond["message"]
    assert any(r == "InvalidSpec" for _, r, _ in op.events)


@pytest.mark.parametrize(("pool", "field"), [
    ({"env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k", "optinal": True}}}]}, "optinal"),
    ({"affinity": {"nodeAffinity": {"requiredDuringScheduling": {}}}}, "requiredDuringScheduling"),
    ({"volumes": [{"name": "c", "configMap": {"name": "x", "defaultMode": "0644"}}]}, "defaultMode"),
])
async def test_fields_the_api_server_would_refuse_are_invalid_spec(env: Env, pool: dict[str, Any],
                                                                   field: str) -> None:
    env.start_operator()
    port = env.cluster.worker_port
    cond = await invalid(env, "bad", spec(port, pools=[{"name": "cpu", "port": port, **pool}]))
    assert "Deployment bad-cpu" in cond["message"] and field in cond["message"]


@pytest.mark.parametrize("service_type", ["LoadBalancer", "NodePort"])
async def test_an_exposed_router_without_api_keys_is_refused(env: Env, service_type: str) -> None:
    op = env.start_operator()
    port = env.cluster.worker_port
    cond = await invalid(env, "open", spec(port, router={"serviceType": service_type}))
    assert "apiKeysSecretRef" in cond["message"]
    assert any(r == "InvalidSpec" and "apiKeysSecretRef" in m for _, r, m in op.events)
    await env.cluster.patch_mllm("open", {"spec": {"router": {"allowUnauthenticated": True}}})
    service = await wait_for(lambda: env.api.get("v1/services", "open-router"), what="applied after opting out")
    assert service["spec"]["type"] == service_type
