"""The one Kubernetes API client: credentials -> httpx, then list, watch, apply, patch, delete.

Plain httpx against the REST API, shared by the operator (child objects, pods, status) and
the router's discovery (list + watch of worker pods); no kubernetes-client objects at run
time, no torch. Where the credentials come from: `Login.auto()` (the in-cluster service
account, else the current kubeconfig context), or any object with the same fields, e.g.
kopf's ConnectionInfo in tests. `connect` is called again after a 401, so a rotated
service-account token is picked up. Writes of child objects are server-side apply
(`application/apply-patch+yaml`, force, one field manager); pod labels/annotations and
status use JSON merge patches.
"""

from __future__ import annotations

import json
import os
import ssl
import tempfile
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

from triptych.kube import names

Obj = dict[str, Any]
APPLY_CONTENT_TYPE = "application/apply-patch+yaml"
MERGE_CONTENT_TYPE = "application/merge-patch+json"
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass(frozen=True)
class Kind:
    api_version: str
    kind: str
    plural: str
    namespaced: bool = True

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]

    def path(self, namespace: str | None = None, name: str | None = None, subresource: str | None = None) -> str:
        base = f"/api/{self.api_version}" if not self.group else f"/apis/{self.api_version}"
        if self.namespaced and namespace:
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        if name:
            base += f"/{name}"
        if subresource:
            base += f"/{subresource}"
        return base


CONFIG_MAP = Kind("v1", "ConfigMap", "configmaps")
SERVICE_ACCOUNT = Kind("v1", "ServiceAccount", "serviceaccounts")
SECRET = Kind("v1", "Secret", "secrets")
SERVICE = Kind("v1", "Service", "services")
POD = Kind("v1", "Pod", "pods")
ROLE = Kind("rbac.authorization.k8s.io/v1", "Role", "roles")
ROLE_BINDING = Kind("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings")
DEPLOYMENT = Kind("apps/v1", "Deployment", "deployments")
PDB = Kind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets")
NETWORK_POLICY = Kind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies")
SERVICE_MONITOR = Kind("monitoring.coreos.com/v1", "ServiceMonitor", "servicemonitors")
MLLM = Kind(names.API_VERSION, names.KIND, names.PLURAL)
KINDS: tuple[Kind, ...] = (CONFIG_MAP, SERVICE_ACCOUNT, SECRET, SERVICE, POD, ROLE, ROLE_BINDING, DEPLOYMENT,
                           PDB, NETWORK_POLICY, SERVICE_MONITOR, MLLM)


class Credentials(Protocol):
    """How to reach the API server and as whom: the fields of kopf's ConnectionInfo we use
    (so the operator can hand kopf and this client the same login)."""

    server: str
    ca_path: Any
    ca_data: Any
    insecure: bool | None
    username: str | None
    password: str | None
    scheme: str | None
    token: str | None
    certificate_path: Any
    certificate_data: Any
    private_key_path: Any
    private_key_data: Any


@dataclass(frozen=True)
class Login:
    """Credentials found in the environment: the pod's service account or a kubeconfig."""

    server: str
    ca_path: str | None = None
    ca_data: str | bytes | None = None
    insecure: bool | None = None
    username: str | None = None
    password: str | None = None
    scheme: str | None = None
    token: str | None = None
    certificate_path: str | None = None
    certificate_data: str | bytes | None = None
    private_key_path: str | None = None
    private_key_data: str | bytes | None = None

    @classmethod
    def in_cluster(cls, account_dir: Path = SERVICE_ACCOUNT_DIR) -> Login:
        # Read on every call: bound service-account tokens rotate (KubeClient re-connects on 401).
        host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
        host = f"[{host}]" if ":" in host else host
        return cls(server=f"https://{host}:{port}", token=(account_dir / "token").read_text().strip(),
                   ca_path=str(account_dir / "ca.crt"))

    @classmethod
    def from_kubeconfig(cls, config_file: str | None = None) -> Login:
        """The current context of $KUBECONFIG (or ~/.kube/config), as kopf.login_via_client reads it."""
        import kubernetes.client  # lazily: only outside a cluster
        import kubernetes.config

        config = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(config_file=config_file, client_configuration=config)
        header = config.get_api_key_with_prefix("BearerToken") or config.get_api_key_with_prefix("authorization")
        scheme, token = header.split(" ", 1) if header and " " in header else ("Bearer", header)
        return cls(server=config.host, token=token or None, scheme=scheme, ca_path=config.ssl_ca_cert,
                   certificate_path=config.cert_file, private_key_path=config.key_file,
                   username=config.username or None, password=config.password or None,
                   insecure=not config.verify_ssl)

    @classmethod
    def auto(cls) -> Login:
        return cls.in_cluster() if "KUBERNETES_SERVICE_HOST" in os.environ else cls.from_kubeconfig()


class KubeApiError(RuntimeError):
    def __init__(self, status: int, method: str, path: str, message: str):
        super().__init__(f"{method} {path}: HTTP {status}: {message}")
        self.status = status


def _as_file(data: str | bytes, suffix: str) -> str:
    raw = data.encode() if isinstance(data, str) else data
    fd, path = tempfile.mkstemp(suffix=suffix)  # 0600: may hold a private key
    with os.fdopen(fd, "wb") as f:
        f.write(raw)
    return path


def _client_args(creds: Credentials) -> dict[str, Any]:
    headers: dict[str, str] = {}
    if creds.token:
        headers["Authorization"] = f"{creds.scheme or 'Bearer'} {creds.token}"
    auth = httpx.BasicAuth(creds.username, creds.password) if creds.username and creds.password else None
    verify: ssl.SSLContext | bool = True
    if creds.server.startswith("https"):
        if creds.insecure:
            verify = False
        else:
            ca_data = creds.ca_data.decode() if isinstance(creds.ca_data, bytes) else creds.ca_data
            verify = ssl.create_default_context(cafile=os.fspath(creds.ca_path) if creds.ca_path else None,
                                                cadata=ca_data)
            cert = creds.certificate_path or (creds.certificate_data and _as_file(creds.certificate_data, ".crt"))
            key = creds.private_key_path or (creds.private_key_data and _as_file(creds.private_key_data, ".key"))
            if cert:
                verify.load_cert_chain(os.fspath(cert), os.fspath(key) if key else None)
    return {"base_url": creds.server.rstrip("/"), "headers": headers, "auth": auth, "verify": verify}


def matches(obj: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    have = obj.get("metadata", {}).get("labels") or {}
    return all(have.get(k) == v for k, v in labels.items())


class KubeClient:
    def __init__(self, connect: Callable[[], Credentials], *, field_manager: str = names.FIELD_MANAGER,
                 timeout: float = 30.0):
        self._connect = connect
        self._field_manager = field_manager
        self._timeout = timeout
        self._client: httpx.AsyncClient | None = None

    def _http(self, *, fresh: bool = False) -> httpx.AsyncClient:
        if self._client is None or fresh:
            self._client = httpx.AsyncClient(timeout=self._timeout, **_client_args(self._connect()))
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _request(self, method: str, path: str, *, params: Mapping[str, str] | None = None,
                       body: Any = None, content_type: str = "application/json") -> httpx.Response:
        content = None if body is None else json.dumps(body).encode()
        headers = {"Accept": "application/json"} | ({"Content-Type": content_type} if content else {})
        response = await self._http().request(method, path, params=params, content=content, headers=headers)
        if response.status_code == 401:  # rotated token: log in again once
            old = self._client
            response = await self._http(fresh=True).request(method, path, params=params, content=content,
                                                            headers=headers)
            if old is not None:
                await old.aclose()
        return response

    @staticmethod
    def _check(response: httpx.Response, method: str, path: str) -> Obj:
        if response.status_code >= 400:
            try:
                message = response.json().get("message", response.text)
            except ValueError:
                message = response.text
            raise KubeApiError(response.status_code, method, path, str(message)[:500])
        return response.json() if response.content else {}

    async def list(self, kind: Kind, namespace: str | None, labels: Mapping[str, str],
                   name: str | None = None) -> list[Obj]:
        """The matching objects; `name` narrows to one by a field selector (read with the
        `list` verb, where `get` is not granted)."""
        items, _ = await self.list_versioned(kind, namespace, labels, name)
        return items

    async def list_versioned(self, kind: Kind, namespace: str | None, labels: Mapping[str, str],
                             name: str | None = None) -> tuple[list[Obj], str]:
        """The matching objects and the list's resourceVersion (where a watch starts)."""
        path = kind.path(namespace)
        params = {"labelSelector": label_selector(labels)}
        if name is not None:
            params["fieldSelector"] = f"metadata.name={name}"
        data = self._check(await self._request("GET", path, params=params), "GET", path)
        # The server filters by the selectors; checking again keeps us correct against any server.
        items = [o for o in data.get("items", []) if matches(o, labels)
                 and (name is None or (o.get("metadata") or {}).get("name") == name)]
        return items, str((data.get("metadata") or {}).get("resourceVersion", ""))

    async def watch(self, kind: Kind, namespace: str | None, labels: Mapping[str, str], *,
                    resource_version: str = "", timeout_seconds: int = 300) -> AsyncIterator[tuple[str, Obj]]:
        """(type, object) events until the server ends the watch after `timeout_seconds`.
        An ERROR event (e.g. 410 Gone: the resourceVersion is too old) raises KubeApiError."""
        path = kind.path(namespace)
        params = {"labelSelector": label_selector(labels), "watch": "true", "allowWatchBookmarks": "true",
                  "timeoutSeconds": str(timeout_seconds)}
        if resource_version:
            params["resourceVersion"] = resource_version
        # The read timeout outlasts the server-side one: a silent watch is not a dead connection.
        timeout = httpx.Timeout(self._timeout, read=timeout_seconds + self._timeout)
        async with self._http().stream("GET", path, params=params, timeout=timeout,
                                       headers={"Accept": "application/json"}) as response:
            if response.status_code >= 400:
                await response.aread()
                self._check(response, "GET", path)
            async for line in response.aiter_lines():
                if not line.strip():
                    continue
                event = json.loads(line)
                type_, obj = event.get("type", ""), event.get("object") or {}
                if type_ == "ERROR":
                    raise KubeApiError(int(obj.get("code") or 500), "WATCH", path, str(obj.get("message", obj)))
                yield type_, obj

    async def get(self, kind: Kind, namespace: str, name: str) -> Obj | None:
        path = kind.path(namespace, name)
        response = await self._request("GET", path)
        if response.status_code == 404:
            return None
        return self._check(response, "GET", path)

    async def create(self, kind: Kind, obj: Mapping[str, Any]) -> Obj | None:
        """Create `obj`; None when it exists already (HTTP 409)."""
        path = kind.path(obj["metadata"].get("namespace"))
        response = await self._request("POST", path, params={"fieldManager": self._field_manager}, body=obj)
        if response.status_code == 409:
            return None
        return self._check(response, "POST", path)

    async def apply(self, obj: Mapping[str, Any]) -> Obj:
        """Server-side apply: create or update `obj`, owning every field it sets."""
        kind = kind_of(obj)
        meta = obj["metadata"]
        path = kind.path(meta.get("namespace"), meta["name"])
        params = {"fieldManager": self._field_manager, "force": "true"}
        response = await self._request("PATCH", path, params=params, body=obj, content_type=APPLY_CONTENT_TYPE)
        return self._check(response, "PATCH", path)

    async def patch(self, kind: Kind, namespace: str, name: str, patch: Mapping[str, Any], *,
                    subresource: str | None = None) -> Obj:
        path = kind.path(namespace, name, subresource)
        params = {"fieldManager": self._field_manager}
        response = await self._request("PATCH", path, params=params, body=patch, content_type=MERGE_CONTENT_TYPE)
        return self._check(response, "PATCH", path)

    async def delete(self, kind: Kind, namespace: str, name: str) -> None:
        path = kind.path(namespace, name)
        response = await self._request("DELETE", path, params={"propagationPolicy": "Background"})
        if response.status_code != 404:
            self._check(response, "DELETE", path)

    async def served(self, kind: Kind) -> bool:
        """Whether the API server serves `kind` (discovery; needs no RBAC)."""
        path = f"/apis/{kind.api_version}" if kind.group else f"/api/{kind.api_version}"
        response = await self._request("GET", path)
        if response.status_code == 404:
            return False
        data = self._check(response, "GET", path)
        return any(r.get("name") == kind.plural for r in data.get("resources", []))


def label_selector(labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


_KINDS_BY_TYPE = {(k.api_version, k.kind): k for k in KINDS}


def kind_of(obj: Mapping[str, Any]) -> Kind:
    try:
        return _KINDS_BY_TYPE[(obj["apiVersion"], obj["kind"])]
    except KeyError:
        raise ValueError(f"unsupported object type {obj.get('apiVersion')}/{obj.get('kind')}") from None
