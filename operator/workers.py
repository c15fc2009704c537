"""The operator's side of the worker admin API: switch a worker's role over HTTP.

`POST http://<podIP>:<port>/admin/role {"role": "P"}` returns 200 once the worker runs in
the new role (weights loaded or dropped); only then does the operator relabel the pod, so a
pod's `triptych.dev/role` label never claims a role its worker does not serve.
"""

from __future__ import annotations

import httpx

from triptych.topology import InstanceType


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

    async def set_role(self, ip: str, port: int, role: InstanceType) -> None:
        url = f"http://{ip}:{port}/admin/role"
        try:
            response = await self._http().post(url, json={"role": role.value})
        except httpx.HTTPError as e:
            raise RoleSwitchError(f"{url}: {type(e).__name__}: {e}") from e
        if response.status_code != 200:
            raise RoleSwitchError(f"{url}: HTTP {response.status_code}: {response.text[:200]}")

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
