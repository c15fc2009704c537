"""Worker discovery in Kubernetes: watch the worker pods of one MLLMDeployment.

The router lists and watches pods labelled `triptych.dev/deployment=<name>` and
`app.kubernetes.io/component=worker` in its namespace (RBAC: pods list + watch, nothing
else). A pod becomes an endpoint when it is Ready, has an IP, carries a role label
(`triptych.dev/role`, written by the operator after the worker switched) and the worker's
own `GET /health` reports that same role; pods of other deployments never match the
selector, so they never get this router's traffic. Roles are re-confirmed every
`health_interval` seconds and whenever a pod changes.

The API calls go through the shared client (triptych/kube/client.py); the label names
come from triptych/kube/names.py, the same module the operator writes them with. No torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from triptych.kube import names
from triptych.kube.client import POD, KubeApiError, KubeClient, Login

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerEndpoint:
    url: str  # http://<podIP>:<port>
    role: str  # instance type, e.g. "P"
    pod: str


@dataclass(frozen=True)
class _Pod:
    name: str  # the pod's name; "<pod>/<role>" for each worker of a pod that runs several
    url: str
    role: str | None  # label; None when unassigned or not routable (not ready, no IP, deleting)
    pod: str = ""  # the pod's name (WorkerEndpoint.pod)


def _pod_views(pod: Mapping[str, Any], default_port: int) -> list[_Pod]:
    """One view per worker of the pod: a pod annotated `triptych.dev/workers` (a shared-GPU
    pod: EP and D on one GPU) runs one worker per listed role=port, each confirmed by its own
    /health; any other pod runs one worker on its `http` port, with the role of its label."""
    meta, status = pod.get("metadata", {}), pod.get("status") or {}
    ip = status.get("podIP")
    port = default_port
    for container in (pod.get("spec") or {}).get("containers", []):
        for p in container.get("ports") or []:
            if p.get("name") == names.PORT_NAME:
                port = int(p["containerPort"])
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    role = (meta.get("labels") or {}).get(names.LABEL_ROLE)
    live = bool(ready and ip and not meta.get("deletionTimestamp"))
    workers = _listed_workers((meta.get("annotations") or {}).get(names.ANNOTATION_WORKERS))
    name = meta["name"]
    if workers:
        # Both roles were fixed at start; the label (the first worker's role) is not needed.
        return [_Pod(name=f"{name}/{r}", url=f"http://{ip}:{p}", role=r if live else None, pod=name)
                for r, p in workers]
    routable = live and role in names.ROLES
    return [_Pod(name=name, url=f"http://{ip}:{port}", role=role if routable else None, pod=name)]


def _listed_workers(annotation: str | None) -> list[tuple[str, int]]:
    """`EP=8100,D=8101` -> [("EP", 8100), ("D", 8101)]; entries that do not parse are skipped."""
    out = []
    for entry in (annotation or "").split(","):
        role, _, port = entry.strip().partition("=")
        if role in names.ROLES and port.isdigit():
            out.append((role, int(port)))
    return out


class KubernetesDiscovery:
    """Keeps `current()` equal to the confirmed workers of one deployment."""

    def __init__(self, namespace: str, deployment: str, *, kube: KubeClient | None = None,
                 on_change: Callable[[list[WorkerEndpoint]], None] | None = None,
                 health_interval: float = 5.0, health_timeout: float = 2.0,
                 default_port: int = names.WORKER_PORT,
                 watch_timeout: int = 300, retry_delay: float = 1.0):
        self.namespace = namespace
        self.deployment = deployment
        self._kube = kube
        self._own_kube = kube is None  # closed on stop() when we made it
        self._on_change = on_change
        self._health_interval = health_interval
        self._health_timeout = health_timeout
        self._default_port = default_port
        self._watch_timeout = watch_timeout
        self._retry_delay = retry_delay
        self._pods: dict[str, _Pod] = {}
        self._confirmed: dict[str, WorkerEndpoint] = {}
        self._changed = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._synced = asyncio.Event()

    @property
    def labels(self) -> dict[str, str]:
        return names.worker_selector(self.deployment)

    def current(self) -> list[WorkerEndpoint]:
        return sorted(self._confirmed.values(), key=lambda e: (e.pod, e.url))

    async def start(self) -> None:
        if self._kube is None:
            Login.auto()  # no credentials: fail here, not silently inside the watch task
            self._kube = KubeClient(Login.auto)
        self._tasks = [asyncio.create_task(self._watch_forever(), name="k8s-discovery-watch"),
                       asyncio.create_task(self._confirm_forever(), name="k8s-discovery-health")]

    async def wait_synced(self, timeout: float) -> None:
        """Wait for the first pod listing (not for any worker to be confirmed)."""
        await asyncio.wait_for(self._synced.wait(), timeout)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self._own_kube and self._kube is not None:
            await self._kube.aclose()
            self._kube = None

    async def __aenter__(self) -> KubernetesDiscovery:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # --- watching pods ----------------------------------------------------------------

    def _matches(self, pod: Mapping[str, Any]) -> bool:
        labels = pod.get("metadata", {}).get("labels") or {}
        return all(labels.get(k) == v for k, v in self.labels.items())

    def _set_pod(self, pod: Mapping[str, Any]) -> None:
        self._drop_pod(pod.get("metadata", {}).get("name", ""))
        if self._matches(pod):  # else relabelled away from this deployment
            for view in _pod_views(pod, self._default_port):
                self._pods[view.name] = view
        self._changed.set()

    def _drop_pod(self, name: str) -> None:
        for key in [k for k, v in self._pods.items() if v.pod == name]:
            del self._pods[key]

    async def _watch_forever(self) -> None:
        assert self._kube is not None
        while True:
            try:
                version = await self._list(self._kube)
                await self._watch(self._kube, version)
            except (KubeApiError, httpx.HTTPError, ValueError, KeyError) as e:
                logger.warning("pod watch for %s/%s failed, relisting: %s", self.namespace, self.deployment, e)
                await asyncio.sleep(self._retry_delay)

    async def _list(self, kube: KubeClient) -> str:
        pods, version = await kube.list_versioned(POD, self.namespace, self.labels)
        self._pods = {}
        for pod in pods:
            self._set_pod(pod)
        self._synced.set()
        return version

    async def _watch(self, kube: KubeClient, version: str) -> None:
        async for kind, obj in kube.watch(POD, self.namespace, self.labels, resource_version=version,
                                          timeout_seconds=self._watch_timeout):
            if kind in ("ADDED", "MODIFIED"):
                self._set_pod(obj)
            elif kind == "DELETED":
                self._drop_pod(obj.get("metadata", {}).get("name", ""))
                self._changed.set()
        # The server closed the stream (timeoutSeconds): relist and watch again.

    # --- confirming roles -------------------------------------------------------------

    async def _confirm_forever(self) -> None:
        async with httpx.AsyncClient(timeout=self._health_timeout) as client:
            while True:
                self._changed.clear()
                await self._confirm(client)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), self._health_interval)

    async def _confirm(self, client: httpx.AsyncClient) -> None:
        pods = [p for p in self._pods.values() if p.role is not None]
        reported = await asyncio.gather(*(self._reported_role(client, p) for p in pods))
        confirmed = {p.name: WorkerEndpoint(p.url, p.role, p.pod)
                     for p, role in zip(pods, reported, strict=True) if p.role is not None and role == p.role}
        if confirmed != self._confirmed:
            self._confirmed = confirmed
            if self._on_change is not None:
                self._on_change(self.current())

    @staticmethod
    async def _reported_role(client: httpx.AsyncClient, pod: _Pod) -> str | None:
        try:
            response = await client.get(f"{pod.url}/health")
            return response.json().get("role") if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None
