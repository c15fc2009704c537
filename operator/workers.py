"""The operator's side of the worker admin API: switch a worker's role over HTTP.

`POST http://<podIP>:<port>/admin/role {"role": "P"}` returns 200 once the worker runs in
the new role (weights loaded or dropped); only then does the operator relabel the pod, so a
pod's `triptych.dev/role` label never claims a role its worker does not serve. Every call
carries the deployment's admin token. `GET /health` tells the role the worker really serves:
after a container restart it is `unassigned` again while the pod keeps its old label.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from triptych.topology import UNASSIGNED, InstanceType

HEALTH_TIMEOUT_S = 2.0  # per pod, concurrently: a pass waits at most this long for the health checks


@dataclass(frozen=True)
class WorkerHealth:
    role: str  # an instance type or "unassigned"
    status: str  # "ok", "unassigned", "loading", "draining", ...

    @property
    def up(self) -> bool:
        """Serving HTTP and able to take a role now."""
        return self.status in ("ok", UNASSIGNED)


def _auth(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


class RoleSwitchError(RuntimeError):
    """A worker refused or did not finish a role switch."""


class WorkerAdmin:
    def __init__(self, *, timeout: float = 300.0):
        self._timeout = timeout
        self._client: httpx.AsyncClient | None = None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            # Short connect timeout (an unreachable pod fails fast); a long read timeout
            # because a switch touching E loads or drops weights before it answers.
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(self._timeout, connect=5.0))
        return self._client

    async def set_role(self, ip: str, port: int, role: InstanceType, token: str | None = None) -> None:
        """`token`: the deployment's admin token (tokens.py), sent as a bearer token."""
        url = f"http://{ip}:{port}/admin/role"
        try:
            response = await self._http().post(url, json={"role": role.value}, headers=_auth(token))
        except httpx.HTTPError as e:
            raise RoleSwitchError(f"{url}: {type(e).__name__}: {e}") from e
        if response.status_code != 200:
            raise RoleSwitchError(f"{url}: HTTP {response.status_code}: {response.text[:200]}")

    async def health(self, ip: str, port: int, token: str | None = None) -> WorkerHealth | None:
        """What the worker's `/health` reports, or None when it does not answer with JSON in time
        (a 503 still carries a body: loading, draining, switching)."""
        url = f"http://{ip}:{port}/health"
        try:
            response = await self._http().get(url, headers=_auth(token), timeout=HEALTH_TIMEOUT_S)
            body = response.json()
        except (httpx.HTTPError, ValueError):
            return None
        if not isinstance(body, dict) or not isinstance(body.get("role"), str):
            return None
        return WorkerHealth(role=body["role"], status=str(body.get("status", "")))

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
