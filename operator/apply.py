"""The operator's Kubernetes API client: list, server-side apply, merge patch, delete.

Plain httpx against the REST API, using the credentials kopf logged in with (kubeconfig or
in-cluster service account, see main.py), so the operator holds one identity. Writes of
child objects are server-side apply (`application/apply-patch+yaml`, field manager
`triptych-operator`, force) - the API server creates missing objects and merges changed
ones; pod labels/annotations and the status use JSON merge patches.
"""

from __future__ import annotations

import json
import os
import ssl
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from triptych.operator import names

Obj = dict[str, Any]
APPLY_CONTENT_TYPE = "application/apply-patch+yaml"
MERGE_CONTENT_TYPE = "application/merge-patch+json"


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
SERVICE = Kind("v1", "Service", "services")
POD = Kind("v1", "Pod", "pods")
ROLE_BINDING = Kind("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings")
DEPLOYMENT = Kind("apps/v1", "Deployment", "deployments")
PDB = Kind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets")
NETWORK_POLICY = Kind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies")
SERVICE_MONITOR = Kind("monitoring.coreos.com/v1", "ServiceMonitor", "servicemonitors")
MLLM = Kind(names.API_VERSION, names.KIND, names.PLURAL)

# Children in apply order (config and identity before the pods that use them). Prunable
# kinds are the ones whose set of objects changes with the spec (pools, toggles).
CHILD_KINDS: tuple[Kind, ...] = (CONFIG_MAP, SERVICE_ACCOUNT, ROLE_BINDING, SERVICE, DEPLOYMENT, PDB,
                                 NETWORK_POLICY, SERVICE_MONITOR)
PRUNABLE: frozenset[str] = frozenset({"Deployment", "PodDisruptionBudget", "NetworkPolicy", "ServiceMonitor"})


class KubeApiError(RuntimeError):
    def __init__(self, status: int, method: str, path: str, message: str):
        super().__init__(f"{method} {path}: HTTP {status}: {message}")
        self.status = status


class Credentials(Protocol):
    """The fields of kopf.ConnectionInfo we use."""

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

    async def list(self, kind: Kind, namespace: str | None, labels: Mapping[str, str]) -> list[Obj]:
        path = kind.path(namespace)
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        data = self._check(await self._request("GET", path, params={"labelSelector": selector}), "GET", path)
        # The server filters by the selector; checking again keeps us correct against any server.
        return [o for o in data.get("items", []) if matches(o, labels)]

    async def get(self, kind: Kind, namespace: str, name: str) -> Obj | None:
        path = kind.path(namespace, name)
        response = await self._request("GET", path)
        if response.status_code == 404:
            return None
        return self._check(response, "GET", path)

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


_KINDS_BY_TYPE = {(k.api_version, k.kind): k for k in (*CHILD_KINDS, POD, MLLM)}


def kind_of(obj: Mapping[str, Any]) -> Kind:
    try:
        return _KINDS_BY_TYPE[(obj["apiVersion"], obj["kind"])]
    except KeyError:
        raise ValueError(f"unsupported object type {obj.get('apiVersion')}/{obj.get('kind')}") from None
