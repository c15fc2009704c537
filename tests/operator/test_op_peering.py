"""Two operator replicas with kopf peering: exactly one acts, the other takes over when it leaves."""

from __future__ import annotations

import pytest
from kube_harness import NS, Env, sender, wait_for
from test_op_integration import settle, spec

pytestmark = pytest.mark.timeout(120)
PEERING = "triptych-operator"
CLUSTER_PEERINGS = "kopf.dev/v1/clusterkopfpeerings"


def keepalives(env: Env, resource: str = CLUSTER_PEERINGS, namespace: str | None = None) -> dict:
    return (env.api.get(resource, PEERING, namespace=namespace) or {}).get("status") or {}


def acting(env: Env, since: int) -> set[str]:
    """The operators that wrote anything besides the peering object (children, pods, status,
    finalizers, events)."""
    return {who for r in env.writes(since) if (who := sender(r)) and r.resource is not None
            and r.resource.plural not in ("clusterkopfpeerings", "kopfpeerings")}


async def test_only_the_oldest_peer_acts_and_the_next_takes_over(env: Env) -> None:
    first = env.start_operator(peering=PEERING, user="first")
    await first.ready()
    await wait_for(lambda: len(keepalives(env)) == 1, what="the first operator's keep-alive")
    await env.start_operator(peering=PEERING, user="second").ready()
    await wait_for(lambda: len(keepalives(env)) == 2, what="both keep-alives")
    mark = env.mark()

    await env.cluster.create_mllm("demo", spec(env.cluster.worker_port, {"E": 1, "P": 1, "D": 1}))
    await settle(env, "demo", 3)
    await env.cluster.delete_pod(sorted(env.cluster.pods())[0])  # a pod event and a role to reassign
    await env.cluster.reconcile_replicas()
    await wait_for(lambda: env.cluster.mllm("demo")["status"]["instances"] == "3/3", what="replacement pod")
    assert acting(env, mark) == {"first"}

    await first.stop()  # leaving removes its keep-alive: the second resumes
    await wait_for(lambda: len(keepalives(env)) == 1, what="the first operator's keep-alive gone")
    mark = env.mark()
    await env.cluster.patch_mllm("demo", {"spec": {"topology": {"D": 2}}})
    await wait_for(lambda: env.api.get("apps/v1/deployments", "demo-cpu")["spec"]["replicas"] == 4,
                   what="the second operator scaled the pool")
    await env.cluster.reconcile_replicas()
    await wait_for(lambda: env.cluster.mllm("demo")["status"]["instances"] == "4/4", what="4/4")
    assert acting(env, mark) == {"second"}


async def test_namespaced_operators_peer_in_each_namespace(env: Env) -> None:
    await env.start_operator(namespaces=[NS], peering=PEERING, user="only").ready()
    await wait_for(lambda: keepalives(env, "kopf.dev/v1/kopfpeerings", NS), what="KopfPeering keep-alive")
    assert env.api.get(CLUSTER_PEERINGS, PEERING, namespace=None) is None
    await env.cluster.create_mllm("demo", spec(env.cluster.worker_port))
    await wait_for(lambda: env.api.get("apps/v1/deployments", "demo-cpu"), what="a lone peer acts")
    assert not env.cluster.mllm("demo")["metadata"].get("finalizers")  # deletion never waits for us
