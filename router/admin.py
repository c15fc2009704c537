"""The router's admin API: role switches (EPDServe §3.2.4, offload -> migrate -> onload).

`POST /admin/role` `{"instance": "<instance id>", "role": "P"}` with
`Authorization: Bearer <admin token>` takes the instance out of rotation at once (the
registry marks it switching, so no new work of its old role goes there), asks the worker to
switch (forwarding the admin token), and answers the worker's report: each phase's
seconds and how many requests were migrated and handed back. Instance ids are the ones
the router's `/health` lists to an admin.

`GET /admin/timings?since=N` (the same token) returns the router's exact recent per-request
overheads (overhead.py, triptych/timings.py), for `bench serve`.
"""

from __future__ import annotations

import hmac
import logging

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from triptych.router.errors import error_type
from triptych.router.registry import Registry
from triptych.timings import TIMINGS, TimingsPage
from triptych.topology import UNASSIGNED, InstanceType

log = logging.getLogger("triptych.router.admin")

# A switch waits for in-flight prefills and migrations (bounded by the worker's drain
# timeout) and may load a model part; this bounds the whole call.
SWITCH_TIMEOUT_S = 180.0


class RoleSwitchRequest(BaseModel):
    instance: str
    role: str


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": error_type(status), "param": None,
                                   "code": status}}, status_code=status)


def _auth_failure(request: Request, token: str | None) -> JSONResponse | None:
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return _error(401, "the admin API needs Authorization: Bearer <admin token>")
    if not token or not hmac.compare_digest(given.strip().encode(), token.encode()):
        return _error(403, "wrong admin token" if token else "this router has no admin token configured")
    return None


def add_admin_routes(app: FastAPI, registry: Registry, client: httpx.AsyncClient, admin_token: str | None) -> None:
    @app.get("/admin/timings", response_model=None)
    async def timings(request: Request, since: int = 0) -> JSONResponse | TimingsPage:
        # Exact recent per-request overheads of this router (overhead.py; bench serve).
        denied = _auth_failure(request, admin_token)
        return denied if denied is not None else TIMINGS.page(since)

    @app.post("/admin/role")
    async def switch_role(request: Request) -> JSONResponse:
        denied = _auth_failure(request, admin_token)
        if denied is not None:
            return denied
        try:
            body = RoleSwitchRequest.model_validate_json(await request.body())
        except ValidationError as exc:
            return _error(400, f"expected {{\"instance\": str, \"role\": str}}: {exc.errors()[0]['msg']}")
        if body.role != UNASSIGNED and body.role not in InstanceType.__members__:
            return _error(400, f"unknown role {body.role!r}; expected one of "
                               f"{', '.join(t.value for t in InstanceType)} or {UNASSIGNED}")
        inst = registry.by_instance_id(body.instance)
        if inst is None:
            return _error(404, f"no instance {body.instance!r}; the router's /health lists them")
        registry.mark_switching(inst.url, body.role)
        try:
            resp = await client.post(f"{inst.url}/admin/role", json={"role": body.role},
                                     headers={"authorization": f"Bearer {admin_token}"}, timeout=SWITCH_TIMEOUT_S)
        except httpx.HTTPError as exc:
            log.warning("role switch of %s failed: %s", inst.url, exc)
            return _error(502, f"instance {body.instance} did not answer the switch: {type(exc).__name__}")
        finally:
            await registry.switch_ended(client, inst.url)
        try:
            report = resp.json()
        except ValueError:
            report = {"error": {"message": resp.text[:500]}}
        if resp.status_code != 200:
            message = (report.get("error") or {}).get("message", resp.text[:500])
            return _error(502 if resp.status_code >= 500 else resp.status_code,
                          f"instance {body.instance} refused the switch: {message}")
        log.info("instance %s switched to %s: %s", body.instance, body.role, report)
        return JSONResponse({"instance": body.instance, **report})
