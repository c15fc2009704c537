"""The router's admin API: role switches (EPDServe §3.2.4, offload -> migrate -> onload).

`POST /admin/role` `{"instance": "<instance id>", "role": "P"}` with
`Authorization: Bearer <admin token>` takes the instance out of rotation at once (the
registry marks it switching, so no new work of its old role goes there), asks the worker to
switch (forwarding the admin token), and answers the worker's report: each phase's
seconds and how many requests were migrated and handed back. Instance ids are the ones
the router's `/health` lists to an admin.

`POST /admin/instances` `{"url": "http://host:port"}` registers an instance process started
after the router (the local planner's encoder and V scaling, local_connector.py): the router
probes its `/health` and routes to it from then on. `DELETE /admin/instances/<instance id>`
forgets one before it is stopped: no new work goes there, requests already on it finish.
Both need static discovery; under Kubernetes discovery the pods are the instance set.

`GET /admin/timings?since=N` (the same token) returns the router's exact recent per-request
overheads (overhead.py, triptych/timings.py), for `bench serve`.
"""

from __future__ import annotations

import hmac
import logging
from typing import TypeVar

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import AnyHttpUrl, BaseModel, ValidationError

from triptych.router.errors import error_type
from triptych.router.registry import Instance, Registry
from triptych.timings import TIMINGS, TimingsPage
from triptych.topology import UNASSIGNED, InstanceType

log = logging.getLogger("triptych.router.admin")

# A switch waits for in-flight prefills and migrations (bounded by the worker's drain
# timeout) and may load a model part; this bounds the whole call.
SWITCH_TIMEOUT_S = 180.0


class RoleSwitchRequest(BaseModel):
    instance: str
    role: str


class RegisterRequest(BaseModel):
    url: AnyHttpUrl


Body = TypeVar("Body", bound=BaseModel)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": error_type(status), "param": None,
                                   "code": status}}, status_code=status)


def _no_instance(instance_id: str) -> JSONResponse:
    return _error(404, f"no instance {instance_id!r}; the router's /health lists them")


async def _body(request: Request, model: type[Body], shape: str) -> Body | JSONResponse:
    """The request body as `model`, or a 400 that shows the expected `shape`."""
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        return _error(400, f"expected {shape}: {exc.errors()[0]['msg']}")


def _refusal(registry: Registry, inst: Instance) -> JSONResponse | None:
    """Why a just-probed registration is refused: not a worker (502), or its instance id is
    another registered instance's (409); None to keep it."""
    if inst.failures or not inst.instance_id:
        return _error(502, f"{inst.url}/health did not answer as a Triptych worker")
    taken = next((i for i in registry.instances.values() if i is not inst and i.instance_id == inst.instance_id), None)
    return _error(409, f"instance id {inst.instance_id!r} is taken by {taken.url}") if taken else None


def _auth_failure(request: Request, token: str | None) -> JSONResponse | None:
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return _error(401, "the admin API needs Authorization: Bearer <admin token>")
    if not token or not hmac.compare_digest(given.strip().encode(), token.encode()):
        return _error(403, "wrong admin token" if token else "this router has no admin token configured")
    return None


def add_admin_routes(app: FastAPI, registry: Registry, client: httpx.AsyncClient, admin_token: str | None,
                     static_discovery: bool = True) -> None:
    add_instance_routes(app, registry, client, admin_token, static_discovery)

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
        body = await _body(request, RoleSwitchRequest, '{"instance": str, "role": str}')
        if isinstance(body, JSONResponse):
            return body
        if body.role != UNASSIGNED and body.role not in InstanceType.__members__:
            return _error(400, f"unknown role {body.role!r}; expected one of "
                               f"{', '.join(t.value for t in InstanceType)} or {UNASSIGNED}")
        inst = registry.by_instance_id(body.instance)
        if inst is None:
            return _no_instance(body.instance)
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


def add_instance_routes(app: FastAPI, registry: Registry, client: httpx.AsyncClient, admin_token: str | None,
                        static_discovery: bool) -> None:
    def refused(request: Request) -> JSONResponse | None:
        denied = _auth_failure(request, admin_token)
        if denied is None and not static_discovery:
            return _error(409, "this router discovers its instances from Kubernetes; scale the deployment instead")
        return denied

    @app.post("/admin/instances")
    async def register(request: Request) -> JSONResponse:
        denied = refused(request)
        if denied is not None:
            return denied
        body = await _body(request, RegisterRequest, '{"url": "http://host:port"}')
        if isinstance(body, JSONResponse):
            return body
        url = str(body.url).rstrip("/")
        if url in registry.instances:
            return _error(409, f"{url} is registered already")
        inst = registry.add_url(url)
        await registry.refresh_one(client, inst)
        refusal = _refusal(registry, inst)
        if refusal is not None:
            registry.remove_url(url)
            return refusal
        log.info("registered instance %s at %s (%s)", inst.instance_id, url, inst.role)
        return JSONResponse({"instance_id": inst.instance_id, "url": url, "ready": inst.ready,
                             "role": inst.role.value if inst.role else UNASSIGNED})

    @app.delete("/admin/instances/{instance_id}")
    async def unregister(request: Request, instance_id: str) -> JSONResponse:
        denied = refused(request)
        if denied is not None:
            return denied
        inst = registry.by_instance_id(instance_id)
        if inst is None:
            return _no_instance(instance_id)
        registry.remove_url(inst.url)
        log.info("unregistered instance %s at %s", instance_id, inst.url)
        return JSONResponse({"instance_id": instance_id, "url": inst.url})
