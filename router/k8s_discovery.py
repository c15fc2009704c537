"""Worker discovery in Kubernetes: watch the worker pods of one MLLMDeployment.

The router lists and watches pods labelled `triptych.dev/deployment=<name>` and
`app.kubernetes.io/component=worker` in its namespace (RBAC: pods list + watch, nothing
else). A pod becomes an endpoint when it is Ready, has an IP, carries a role label
(`triptych.dev/role`, written by the operator after the worker switched) and the worker's
own `GET /health` reports that same role; pods of other deployments never match the
selector, so they never get this router's traffic. Roles are re-confirmed every
`health_interval` seconds and whenever a pod changes.

Plain httpx against the API server; no torch, no other router module.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

logger = logging.getLogger(__name__)

LABEL_DEPLOYMENT = "triptych.dev/deployment"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_ROLE = "triptych.dev/role"
ROLES = frozenset({"E", "P", "D", "EP", "ED", "PD", "EPD"})
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass(frozen=True)
class WorkerEndpoint:
    url: str  # http://<podIP>:<port>
    role: str  # instance type, e.g. "P"
    pod: str


@dataclass(frozen=True)
class KubeAccess:
    """How to reach the API server: in-cluster service account or a kubeconfig context."""

    server: str
    token: str | None = None
    token_file: str | None = None  # re-read on every connect: bound tokens rotate
    ca_file: str | None = None
    client_cert: tuple[str, str] | None = None
    verify: bool = True

    @classmethod
    def in_cluster(cls) -> KubeAccess:
        host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
        host = f"[{host}]" if ":" in host else host
        return cls(server=f"https://{host}:{port}", token_file=str(SERVICE_ACCOUNT_DIR / "token"),
                   ca_file=str(SERVICE_ACCOUNT_DIR / "ca.crt"))

    @classmethod
    def from_kubeconfig(cls) -> KubeAccess:
        import kubernetes.client  # lazily: only outside a cluster
        import kubernetes.config

        config = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(client_configuration=config)
        header = config.get_api_key_with_prefix("BearerToken") or config.get_api_key_with_prefix("authorization")
        token = header.split(" ", 1)[-1] if header else None
        cert = (config.cert_file, config.key_file) if config.cert_file else None
        return cls(server=config.host, token=token, ca_file=config.ssl_ca_cert, client_cert=cert,
                   verify=bool(config.verify_ssl))

    @classmethod
    def auto(cls) -> KubeAccess:
        return cls.in_cluster() if "KUBERNETES_SERVICE_HOST" in os.environ else cls.from_kubeconfig()

    def client(self, timeout: httpx.Timeout) -> httpx.AsyncClient:
        headers = {}
        token = Path(self.token_file).read_text().strip() if self.token_file else self.token
        if token:
            headers["Authorization"] = f"Bearer {token}"
        verify: ssl.SSLContext | bool = self.verify
        if self.verify and self.server.startswith("https"):
            verify = ssl.create_default_context(cafile=self.ca_file)
            if self.client_cert:
                verify.load_cert_chain(*self.client_cert)
        return httpx.AsyncClient(base_url=self.server, headers=headers, verify=verify, timeout=timeout)


@dataclass(frozen=True)
class _Pod:
    name: str
    url: str
    role: str | None  # label; None when unassigned or not routable (not ready, no IP, deleting)


def _pod_view(pod: Mapping[str, Any], default_port: int) -> _Pod:
    meta, status = pod.get("metadata", {}), pod.get("status") or {}
    ip = status.get("podIP")
    port = default_port
    for container in (pod.get("spec") or {}).get("containers", []):
        for p in container.get("ports") or []:
            if p.get("name") == "http":
                port = int(p["containerPort"])
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    role = (meta.get("labels") or {}).get(LABEL_ROLE)
    routable = ready and ip and not meta.get("deletionTimestamp") and role in ROLES
    return _Pod(name=meta["name"], url=f"http://{ip}:{port}", role=role if routable else None)


class KubernetesDiscovery:
    """Keeps `current()` equal to the confirmed workers of one deployment."""

    def __init__(self, namespace: str, deployment: str, *, access: KubeAccess | None = None,
                 on_change: Callable[[list[WorkerEndpoint]], None] | None = None,
                 health_interval: float = 5.0, health_timeout: float = 2.0, default_port: int = 8100,
                 watch_timeout: int = 300, retry_delay: float = 1.0):
        self.namespace = namespace
        self.deployment = deployment
        self._access = access
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
    def selector(self) -> str:
        return f"{LABEL_COMPONENT}=worker,{LABEL_DEPLOYMENT}={self.deployment}"

    def current(self) -> list[WorkerEndpoint]:
        return sorted(self._confirmed.values(), key=lambda e: e.pod)

    async def start(self) -> None:
        self._access = self._access or KubeAccess.auto()
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

    async def __aenter__(self) -> KubernetesDiscovery:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # --- watching pods ----------------------------------------------------------------

    def _matches(self, pod: Mapping[str, Any]) -> bool:
        labels = pod.get("metadata", {}).get("labels") or {}
        return labels.get(LABEL_DEPLOYMENT) == self.deployment and labels.get(LABEL_COMPONENT) == "worker"

    def _set_pod(self, pod: Mapping[str, Any]) -> None:
        if self._matches(pod):
            self._pods[pod["metadata"]["name"]] = _pod_view(pod, self._default_port)
        else:  # relabelled away from this deployment
            self._pods.pop(pod.get("metadata", {}).get("name", ""), None)
        self._changed.set()

    async def _watch_forever(self) -> None:
        assert self._access is not None
        path = f"/api/v1/namespaces/{self.namespace}/pods"
        while True:
            try:
                timeout = httpx.Timeout(30.0, read=self._watch_timeout + 30.0)
                async with self._access.client(timeout) as client:
                    version = await self._list(client, path)
                    await self._watch(client, path, version)
            except (httpx.HTTPError, ValueError, KeyError) as e:
                logger.warning("pod watch for %s/%s failed, relisting: %s", self.namespace, self.deployment, e)
                await asyncio.sleep(self._retry_delay)

    async def _list(self, client: httpx.AsyncClient, path: str) -> str:
        response = await client.get(path, params={"labelSelector": self.selector})
        response.raise_for_status()
        data = response.json()
        self._pods = {}
        for pod in data.get("items", []):
            self._set_pod(pod)
        self._synced.set()
        return str(data.get("metadata", {}).get("resourceVersion", ""))

    async def _watch(self, client: httpx.AsyncClient, path: str, version: str) -> None:
        params = {"labelSelector": self.selector, "watch": "true", "allowWatchBookmarks": "true",
                  "timeoutSeconds": str(self._watch_timeout)}
        if version:
            params["resourceVersion"] = version
        async with client.stream("GET", path, params=params) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":  # e.g. 410 Gone: our resourceVersion is too old
                    raise ValueError(f"watch error: {obj.get('message', obj)}")
                if kind in ("ADDED", "MODIFIED"):
                    self._set_pod(obj)
                elif kind == "DELETED":
                    self._pods.pop(obj.get("metadata", {}).get("name", ""), None)
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
        confirmed = {p.name: WorkerEndpoint(p.url, p.role, p.name)
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
