"""Harness for the operator's integration tests: kmock as the API server, the real kopf
runtime in a thread, the tests playing the controllers that kmock does not run.

No API server can run here (DESIGN.md). kmock 0.8 emulates object storage and watches; this
subclass adds the few API-server behaviours the operator relies on:
  - server-side apply (PATCH application/apply-patch+yaml) creates a missing object and,
    for an existing one, replaces the fields it sends (spec, data, ...) as the only field
    manager would, merging labels and annotations and keeping the status;
  - `generateName`, uid, resourceVersion, creationTimestamp and metadata.generation.
The tests then play the ReplicaSet controller (create pods from a Deployment's template,
delete the lowest pod-deletion-cost pods on scale-down) and the kubelet (podIP, Ready).
A small aiohttp server on 127.0.0.N stands in for each pod's worker (`/health`, `/ready`,
`/admin/role`, which requires the admin token from the deployment's Secret), so role
assignment goes through real HTTP.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import datetime
import itertools
import json
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import aiohttp.web
import kmock
import kopf
import yaml

from triptych.kube import names
from triptych.operator.context import OperatorConfig, OperatorContext
from triptych.operator.main import run

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"

NS = "serving"
MLLM_RES = f"{names.API_VERSION}/{names.PLURAL}"
APPLY = "application/apply-patch+yaml"
RESOURCES: dict[str, tuple[str, bool, set[str]]] = {
    "v1/namespaces": ("Namespace", False, set()),
    "apiextensions.k8s.io/v1/customresourcedefinitions": ("CustomResourceDefinition", False, set()),
    MLLM_RES: (names.KIND, True, {"status"}),
    "v1/pods": ("Pod", True, set()),
    "v1/events": ("Event", True, set()),
    "v1/configmaps": ("ConfigMap", True, set()),
    "v1/services": ("Service", True, set()),
    "v1/serviceaccounts": ("ServiceAccount", True, set()),
    "rbac.authorization.k8s.io/v1/roles": ("Role", True, set()),
    "rbac.authorization.k8s.io/v1/rolebindings": ("RoleBinding", True, set()),
    "v1/secrets": ("Secret", True, set()),
    "apps/v1/deployments": ("Deployment", True, set()),
    "policy/v1/poddisruptionbudgets": ("PodDisruptionBudget", True, set()),
    "networking.k8s.io/v1/networkpolicies": ("NetworkPolicy", True, set()),
    "kopf.dev/v1/clusterkopfpeerings": ("ClusterKopfPeering", False, set()),
    "kopf.dev/v1/kopfpeerings": ("KopfPeering", True, set()),
}
SERVICE_MONITORS = "monitoring.coreos.com/v1/servicemonitors"
VERBS = {"get", "list", "watch", "create", "patch", "update", "delete"}
TEST_AGENT = "triptych-tests"  # the tests' own requests; everything else is the code under test


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _merge_patch(old: Any, new: Any) -> Any:
    """RFC 7386 patch turning `old` into `new` (independent of the operator's own helper)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    patch = {k: None for k in old if k not in new}
    for k, v in new.items():
        if k not in old or old[k] != v:
            patch[k] = _merge_patch(old[k], v) if k in old else v
    return patch


class ApiServer(kmock.KubernetesEmulator):
    """kmock plus server-side apply, generated names and object metadata."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.applied_creates: set[int] = set()  # ids of apply requests that created an object
        self._versions = itertools.count(1000)

    def key(self, request: Any) -> tuple[Any, Any, Any]:
        return (request.resource, request.namespace, request.name)

    async def _handle(self, request: Any) -> Any:
        if request.resource is not None and isinstance(request.data, dict):
            async with self._lock:
                self._prepare(request)
        return await super()._handle(request)

    def _prepare(self, request: Any) -> None:
        data = request.data
        meta = data.setdefault("metadata", {})
        if request.action == kmock.action.CREATE:
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            self._stamp_new(meta)
        elif request.action == kmock.action.UPDATE:
            key = self.key(request)
            existing = self._objects[key] if key in self._objects else None
            alive = existing is not None and not existing.deleted
            if request.headers.get("Content-Type") == APPLY and not alive:
                self._stamp_new(meta)
                self._objects[key] = copy.deepcopy(data)
                self.applied_creates.add(request.id)
                return
            if not alive:
                return  # kmock answers 404
            old = existing.raw
            if request.headers.get("Content-Type") == APPLY:
                target = {k: v for k, v in data.items() if k not in ("metadata", "status")}
                target["metadata"] = {**old.get("metadata", {}), **meta}
                for k in ("labels", "annotations"):
                    target["metadata"][k] = {**(old["metadata"].get(k) or {}), **(meta.get(k) or {})}
                if "status" in old:
                    target["status"] = old["status"]
                request.data.clear()
                request.data.update(_merge_patch(old, target))
                meta = request.data.setdefault("metadata", {})
            if "spec" in request.data and request.subresource is None:
                if _merge_patch(old.get("spec"), request.data["spec"]) or request.data["spec"] is None:
                    meta["generation"] = int(old.get("metadata", {}).get("generation", 1)) + 1
            meta["resourceVersion"] = str(next(self._versions))

    def _stamp_new(self, meta: dict[str, Any]) -> None:
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", _now())
        meta.setdefault("generation", 1)
        meta["resourceVersion"] = str(next(self._versions))

    # --- helpers for tests ------------------------------------------------------------

    def get(self, resource: str, name: str, namespace: str | None = NS) -> dict[str, Any] | None:
        key = (kmock.resource(resource), namespace, name)
        obj = self._objects[key] if key in self._objects else None
        return None if obj is None or obj.deleted else json.loads(json.dumps(obj.raw, default=dict))

    def all(self, resource: str, namespace: str | None = NS) -> dict[str, dict[str, Any]]:
        res = kmock.resource(resource)
        return {name: self.get(resource, name, ns) for (r, ns, name), obj in self._objects.items()
                if r == res and ns == namespace and not obj.deleted}


@dataclass
class FakeWorker:
    """Stands in for one worker pod: `/health` reports the role, `/admin/role` switches it."""

    ip: str
    port: int
    role: str = "unassigned"
    calls: list[str] = field(default_factory=list)
    refuse: bool = False
    runner: aiohttp.web.AppRunner | None = None
    admin_token: Callable[[], str | None] = lambda: None  # the token /admin/* requires (None: no auth)
    auth: list[str | None] = field(default_factory=list)  # Authorization header of each /admin/role call

    async def start(self) -> None:
        app = aiohttp.web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/ready", self._ready)
        app.router.add_post("/admin/role", self._set_role)
        self.runner = aiohttp.web.AppRunner(app)
        await self.runner.setup()
        await aiohttp.web.TCPSite(self.runner, self.ip, self.port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _health(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.json_response({"status": "unassigned" if self.role == "unassigned" else "ok",
                                          "role": self.role})

    async def _ready(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        ready = self.role != "unassigned"  # as issue 8 asks of the worker: unassigned is not ready
        return aiohttp.web.json_response({"ready": ready, "role": self.role}, status=200 if ready else 503)

    async def _set_role(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        header = request.headers.get("Authorization")
        self.auth.append(header)
        token = self.admin_token()
        if token is not None and header != f"Bearer {token}":
            return aiohttp.web.json_response({"error": "unauthorized"}, status=401)
        role = (await request.json())["role"]
        self.calls.append(role)
        if self.refuse:
            return aiohttp.web.json_response({"error": "refused"}, status=503)
        self.role = role
        return aiohttp.web.json_response({"role": role})


def free_port(host: str = "127.0.0.2") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Cluster:
    """The test's hands: the API (through HTTP, so watches fire) and the missing controllers."""

    def __init__(self, api: ApiServer, client: aiohttp.ClientSession, port: int):
        self.api = api
        self.client = client
        self.worker_port = port
        self.workers: dict[str, FakeWorker] = {}  # pod name -> fake worker
        self._ips = (f"127.0.0.{i}" for i in itertools.count(2))
        self._pod_ids = itertools.count(1)
        # False: pods are Ready at creation. True: the kubelet's readiness probe follows the
        # worker's /ready (false while unassigned), applied by sync_readiness().
        self.ready_follows_worker = False

    async def request(self, method: str, path: str, body: Any = None,
                      content_type: str = "application/json") -> dict[str, Any]:
        data = None if body is None else json.dumps(body)
        async with self.client.request(method, path, data=data, headers={"Content-Type": content_type}) as r:
            payload = await r.json()
            assert r.status < 400, f"{method} {path}: {r.status} {payload}"
            return payload

    # --- the custom resource -----------------------------------------------------------

    async def create_mllm(self, name: str, spec: dict[str, Any], namespace: str = NS) -> None:
        await self.request("POST", f"/apis/{names.API_VERSION}/namespaces/{namespace}/{names.PLURAL}", {
            "apiVersion": names.API_VERSION, "kind": names.KIND,
            "metadata": {"name": name, "namespace": namespace}, "spec": spec})

    async def patch_mllm(self, name: str, patch: dict[str, Any]) -> None:
        await self.request("PATCH", f"/apis/{names.API_VERSION}/namespaces/{NS}/{names.PLURAL}/{name}",
                           patch, "application/merge-patch+json")

    async def delete_mllm(self, name: str) -> None:
        await self.request("DELETE", f"/apis/{names.API_VERSION}/namespaces/{NS}/{names.PLURAL}/{name}")

    def mllm(self, name: str) -> dict[str, Any] | None:
        return self.api.get(MLLM_RES, name)

    def condition(self, name: str, kind: str) -> dict[str, Any] | None:
        obj = self.mllm(name) or {}
        return next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == kind), None)

    # --- playing the ReplicaSet controller and the kubelet ------------------------------

    def pods(self) -> dict[str, dict[str, Any]]:
        return self.api.all("v1/pods")

    async def reconcile_replicas(self) -> None:
        """Create or delete pods so every worker Deployment has `replicas` pods."""
        for dep in self.api.all("apps/v1/deployments").values():
            if dep["metadata"]["labels"].get(names.LABEL_COMPONENT) != names.COMPONENT_WORKER:
                continue
            selector = dep["spec"]["selector"]["matchLabels"]
            mine = [p for p in self.pods().values()
                    if all(p["metadata"]["labels"].get(k) == v for k, v in selector.items())]
            missing = dep["spec"]["replicas"] - len(mine)
            for _ in range(missing):
                await self._create_pod(dep)
            if missing < 0:  # the ReplicaSet deletes the lowest pod-deletion-cost first
                def cost(p: dict[str, Any]) -> int:
                    return int((p["metadata"].get("annotations") or {}).get(names.ANNOTATION_DELETION_COST, 0))
                for pod in sorted(mine, key=cost)[:-missing]:
                    await self.delete_pod(pod["metadata"]["name"])

    async def _create_pod(self, dep: dict[str, Any]) -> None:
        name = f"{dep['metadata']['name']}-{next(self._pod_ids):03d}"
        ip = next(self._ips)
        deployment = dep["metadata"]["labels"][names.LABEL_DEPLOYMENT]
        worker = FakeWorker(ip, self.worker_port, admin_token=lambda: self.admin_token(deployment))
        await worker.start()
        self.workers[name] = worker
        template = dep["spec"]["template"]
        await self.request("POST", f"/api/v1/namespaces/{NS}/pods", {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": dict(template["metadata"]["labels"])},
            "spec": template["spec"],
            "status": {"phase": "Running", "podIP": ip,
                       "conditions": [{"type": "Ready", "status": "False" if self.ready_follows_worker else "True"}]}})

    async def sync_readiness(self) -> None:
        """Play the kubelet's readiness probe: a pod is Ready when its worker serves a role."""
        for name, pod in self.pods().items():
            worker = self.workers.get(name)
            if worker is None:
                continue
            ready = "True" if worker.role != "unassigned" else "False"
            if pod["status"]["conditions"][0]["status"] != ready:
                await self.request("PATCH", f"/api/v1/namespaces/{NS}/pods/{name}",
                                   {"status": {"conditions": [{"type": "Ready", "status": ready}]}},
                                   "application/merge-patch+json")

    def admin_token(self, deployment: str) -> str | None:
        """The admin token in the deployment's tokens Secret (what the worker pods get)."""
        secret = self.api.get("v1/secrets", names.tokens_secret_name(deployment))
        raw = (secret or {}).get("data", {}).get(names.SECRET_KEY_ADMIN_TOKEN)
        return base64.b64decode(raw).decode() if raw else None

    async def delete_pod(self, name: str) -> None:
        await self.request("DELETE", f"/api/v1/namespaces/{NS}/pods/{name}")
        await self.workers.pop(name).stop()

    async def set_router_ready(self, name: str, ready: int = 1) -> None:
        await self.request("PATCH", f"/apis/apps/v1/namespaces/{NS}/deployments/{names.router_name(name)}/status",
                           {"status": {"readyReplicas": ready}}, "application/merge-patch+json")

    async def stop_workers(self) -> None:
        for worker in self.workers.values():
            await worker.stop()


async def wait_for(check: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    """Poll `check` until it returns something truthy; fail with `what` after `timeout`."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        result = check()
        if isinstance(result, Awaitable):
            result = await result
        if result:
            return result
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


class OperatorThread:
    """The real kopf runtime with our handlers, in its own thread and event loop."""

    def __init__(self, url: str, *, timer_interval: float = 0.5, namespaces: list[str] | None = None,
                 peering: str | None = None, priority: int | None = None, user: str = "operator"):
        self.url = url
        self.namespaces = namespaces or []
        self.peering = peering
        self.priority = priority
        self.user = user  # sent as basic auth by kopf and our client: tells this operator's requests apart
        self.config = OperatorConfig(timer_interval=timer_interval, retry_delay=0.2, role_switch_timeout=5.0,
                                     operator_namespace="triptych-system")
        self.events: list[tuple[str, str, str]] = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[Any] | None = None
        self.error: BaseException | None = None

    def _emit(self, body: Any, type_: str, reason: str, message: str) -> None:
        self.events.append((type_, reason, message))
        kopf.event(dict(body), type=type_, reason=reason, message=message)

    def start(self, *, wait: bool = True) -> None:
        """Start kopf; `wait` blocks this thread until kopf is ready - only for operators that
        need no API call before kopf starts (the API emulator runs in the caller's loop)."""
        ctx = OperatorContext(connect=lambda: kopf.ConnectionInfo(server=self.url, username=self.user,
                                                                  password="test"),
                              config=self.config, emit=self._emit)
        settings = kopf.OperatorSettings()
        settings.posting.default_backoffs = 0.1
        settings.networking.error_backoffs = (0.1, 0.2)
        settings.watching.reconnect_backoff = 0.05
        settings.background.cancellation_polling = 0.1
        settings.process.ultimate_exiting_timeout = 5
        settings.peering.lifetime = 5  # a stopped peer that could not say goodbye expires fast

        async def operator() -> None:
            self._loop = asyncio.get_running_loop()
            self._task = asyncio.current_task()
            await run(ctx, namespaces=self.namespaces, peering=self.peering, priority=self.priority,
                      settings=settings, stop_flag=self._stop, ready_flag=self._ready)

        def main() -> None:
            try:
                asyncio.run(operator())
            except asyncio.CancelledError:
                pass  # stop() cancelled a slow exit
            except BaseException as e:  # surfaced by stop()
                self.error = e

        self._thread = threading.Thread(target=main, name="kopf", daemon=True)
        self._thread.start()
        if wait:
            assert self._ready.wait(30), f"kopf did not start: {self.error!r}"

    async def ready(self, timeout: float = 30) -> None:
        assert await asyncio.to_thread(self._ready.wait, timeout), f"kopf did not start: {self.error!r}"

    async def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            # kopf waits 5 s for tasks spawned late in its exit (e.g. a timer re-spawned by a
            # last watch event); cancelling the operator task skips that wait.
            await asyncio.to_thread(self._thread.join, 1.0)
            # Then cancel every task of its loop, again each second: a task kopf left orphaned
            # ("did not exit in time") may swallow one cancellation while asyncio.run waits
            # for it, and the thread would hang there.
            deadline = time.monotonic() + 30
            while self._thread.is_alive() and time.monotonic() < deadline:
                if self._loop is not None:
                    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                        self._loop.call_soon_threadsafe(_cancel_all_tasks, self._loop)
                await asyncio.to_thread(self._thread.join, 1.0)
            assert not self._thread.is_alive(), "kopf did not stop"
        assert self.error is None, f"kopf crashed: {self.error!r}"


def _cancel_all_tasks(loop: asyncio.AbstractEventLoop) -> None:
    for task in asyncio.all_tasks(loop):
        task.cancel()


@contextlib.asynccontextmanager
async def api_server(service_monitors: bool = False) -> AsyncIterator[tuple[ApiServer, str]]:
    async with ApiServer() as api, kmock.Server(api) as server:
        for resource, (kind, namespaced, subresources) in RESOURCES.items():
            api.resources[resource] = kmock.ResourceInfo(kind=kind, namespaced=namespaced,
                                                         subresources=subresources, verbs=VERBS)
        if service_monitors:
            api.resources[SERVICE_MONITORS] = kmock.ResourceInfo(kind="ServiceMonitor", namespaced=True,
                                                                 verbs=VERBS)
        yield api, str(server.url).rstrip("/")


@dataclass
class Env:
    api: ApiServer
    cluster: Cluster
    url: str
    operators: list[OperatorThread] = field(default_factory=list)

    def start_operator(self, namespaces: list[str] | None = None, *, peering: str | None = None,
                       priority: int | None = None, user: str = "operator") -> OperatorThread:
        op = OperatorThread(self.url, namespaces=namespaces, peering=peering, priority=priority, user=user)
        op.start(wait=peering is None)  # with peering, the operator creates the peering object first
        self.operators.append(op)
        return op

    def writes(self, since: int = 0) -> list[Any]:
        return [r for r in list(self.api)[since:] if r.method in ("POST", "PUT", "PATCH", "DELETE")]

    def mark(self) -> int:
        return len(list(self.api))


def sender(request: Any) -> str | None:
    """The operator (OperatorThread.user) that made a request; None for the tests' own."""
    auth = request.headers.get("Authorization", "")
    if request.headers.get("User-Agent") == TEST_AGENT or not auth.startswith("Basic "):
        return None
    return base64.b64decode(auth.removeprefix("Basic ")).decode().partition(":")[0]


def iter_requests(api: ApiServer) -> Iterator[Any]:
    """Requests made by the code under test (not by the test's own hands)."""
    for r in list(api):
        if r.headers.get("User-Agent") != TEST_AGENT:
            yield r


def rbac_needs(api: ApiServer) -> set[tuple[str, str, str]]:
    """(apiGroup, resource[/subresource], verb) for every resource request made by the code
    under test; a server-side apply that created an object is authorized as `create`."""
    needs = set()
    for r in iter_requests(api):
        if r.resource is None or r.resource.plural is None:
            continue  # discovery (/api, /apis/...): non-resource URLs every identity may read
        resource = r.resource.plural + (f"/{r.subresource}" if r.subresource else "")
        if r.method == "GET":
            verb = "watch" if r.params.get("watch") == "true" else "get" if r.name else "list"
        elif r.method == "PATCH":
            verb = "create" if r.id in api.applied_creates else "patch"
        else:
            verb = {"POST": "create", "PUT": "update", "DELETE": "delete"}[r.method]
        needs.add((r.resource.group, resource, verb))
    return needs


def rbac_grants(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {(g, res, v) for rule in rules for g in rule["apiGroups"] for res in rule["resources"]
            for v in rule["verbs"]}


def cluster_role(path: Path, name: str) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    return next(d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == name)["rules"]


def operator_grants() -> set[tuple[str, str, str]]:
    """What deploy/operator-rbac.yaml's ClusterRole allows the operator (and its planner)."""
    return rbac_grants(cluster_role(DEPLOY / "operator-rbac.yaml", "triptych-operator"))
