"""The router's Kubernetes discovery against kmock: its own pods only, roles confirmed by
each worker's /health, and RBAC equal to what it uses."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from kube_harness import (
    NS,
    TEST_AGENT,
    Cluster,
    FakeWorker,
    api_server,
    free_port,
    rbac_grants,
    rbac_needs,
    wait_for,
)

from triptych.kube import names
from triptych.kube.client import KubeClient, Login
from triptych.operator.router_objects import ROUTER_RULES
from triptych.router.k8s_discovery import KubernetesDiscovery, WorkerEndpoint

pytestmark = pytest.mark.timeout(60)


def pod(name: str, deployment: str, ip: str, port: int, role: str | None, ready: bool = True) -> dict[str, Any]:
    labels = names.worker_selector(deployment)
    if role:
        labels[names.LABEL_ROLE] = role
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS, "labels": labels},
            "spec": {"containers": [{"name": "worker",
                                     "ports": [{"name": names.PORT_NAME, "containerPort": port}]}]},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


async def test_discovery_follows_its_own_confirmed_workers() -> None:
    port = free_port()
    async with api_server() as (api, url), aiohttp.ClientSession(
            base_url=url, headers={"User-Agent": TEST_AGENT}) as client:
        cluster = Cluster(api, client, port)
        workers = {name: FakeWorker(f"127.0.0.{i}", port, role=role) for i, (name, role) in enumerate(
            [("demo-1", "P"), ("demo-2", "D"), ("demo-3", "unassigned"), ("demo-4", "P"), ("other-1", "P"),
             ("demo-5", "D")], start=2)}
        for w in workers.values():
            await w.start()
        kube = KubeClient(lambda: Login(server=url))
        try:
            pods = [pod("demo-1", "demo", "127.0.0.2", port, "P"),
                    pod("demo-2", "demo", "127.0.0.3", port, "D"),
                    pod("demo-3", "demo", "127.0.0.4", port, None),  # unassigned: no traffic
                    pod("demo-4", "demo", "127.0.0.5", port, "D"),  # label says D, worker says P
                    pod("other-1", "other", "127.0.0.6", port, "P"),  # another deployment
                    pod("demo-5", "demo", "127.0.0.7", port, "D", ready=False)]
            for p in pods:
                await cluster.request("POST", f"/api/v1/namespaces/{NS}/pods", p)
            seen: list[list[WorkerEndpoint]] = []
            discovery = KubernetesDiscovery(NS, "demo", kube=kube, health_interval=0.2, on_change=seen.append)
            async with discovery:
                await discovery.wait_synced(10)
                expected = [WorkerEndpoint(f"http://127.0.0.2:{port}", "P", "demo-1"),
                            WorkerEndpoint(f"http://127.0.0.3:{port}", "D", "demo-2")]
                await wait_for(lambda: discovery.current() == expected, what="confirmed endpoints")
                assert seen[-1] == expected

                # the operator switches demo-3 to E: worker first, then the label
                workers["demo-3"].role = "E"
                await cluster.request("PATCH", f"/api/v1/namespaces/{NS}/pods/demo-3",
                                      {"metadata": {"labels": {names.LABEL_ROLE: "E"}}},
                                      "application/merge-patch+json")
                await wait_for(lambda: any(e.pod == "demo-3" and e.role == "E" for e in discovery.current()),
                               what="relabelled pod")
                await cluster.request("DELETE", f"/api/v1/namespaces/{NS}/pods/demo-1")
                await wait_for(lambda: [e.pod for e in discovery.current()] == ["demo-2", "demo-3"],
                               what="deleted pod gone")
                workers["demo-2"].role = "P"  # a worker that no longer serves its label drops out
                await wait_for(lambda: [e.pod for e in discovery.current()] == ["demo-3"], what="mismatch")
                assert all(e.pod.startswith("demo-") for batch in seen for e in batch)
        finally:
            await kube.aclose()
            for w in workers.values():
                await w.stop()

        router_rules = ROUTER_RULES  # the Role the operator renders per deployment (router_objects.py)
        assert rbac_needs(api) == rbac_grants(router_rules) == {("", "pods", "list"), ("", "pods", "watch")}
        selectors = {r.params.get("labelSelector") for r in api if r.headers.get("User-Agent") != TEST_AGENT
                     and r.resource is not None and r.resource.plural == "pods"}
        assert selectors == {"app.kubernetes.io/component=worker,triptych.dev/deployment=demo"}


async def test_discovery_without_credentials_fails_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_login() -> Login:
        raise RuntimeError("no service account and no kubeconfig")

    monkeypatch.setattr(Login, "auto", staticmethod(no_login))
    discovery = KubernetesDiscovery(NS, "demo")
    with pytest.raises(RuntimeError, match="no service account"):
        await discovery.start()
    assert discovery.current() == []
