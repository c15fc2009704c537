"""The local connector: a planner decision becomes calls on the router's admin API.

Contract (the router's zero-loss role switching, EPDServe §3.2.4 offload -> migrate ->
onload): `POST <router>/admin/role` with `Authorization: Bearer <admin token>` and body
`{"instance": "<instance id>", "role": "P"}`, answered 200 once the instance serves its
new role. The router's admin view of `/health` lists the instances (id, URL, role, ready,
load), which is where the connector learns who runs what.

Encoder and V scaling without a cluster: scaling up takes a ready standby first
(`triptych serve --autoscale --autoscale-standby N` starts N `unassigned` instances, and
`--autoscale-video-standby N` N parked V processes, warm processes the router knows), then
starts new instance processes (local_spawn.py, when `serve` handed the planner its spawn
spec) and registers each with the router (`POST /admin/instances`). Scaling down stops
instances this planner started first: the router forgets it (`DELETE /admin/instances/<id>`,
no new work goes there) and the process gets SIGTERM, on which the worker drains. Without
started ones left it switches the least-loaded instance of the type to `unassigned` (it
idles, holding no stage; a parked V still decodes the GOP sets of videos already planned
over it), so scaling down loses nothing either way.
"""

from __future__ import annotations

from typing import Any

import httpx

from triptych.local_spawn import InstanceSpawner
from triptych.operator.planner.policy_types import Decision
from triptych.topology import UNASSIGNED, InstanceType


class LocalActionError(RuntimeError):
    """The router refused or could not carry out an action."""


class LocalConnector:
    def __init__(self, router_url: str, admin_token: str | None, timeout_s: float = 300.0,
                 transport: httpx.BaseTransport | None = None, spawner: InstanceSpawner | None = None) -> None:
        self.spawner = spawner
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        # a switch answers once the instance serves its new role (weights loaded or dropped)
        self._http = httpx.Client(base_url=router_url.rstrip("/"), headers=headers,
                                  timeout=httpx.Timeout(timeout_s, connect=5.0), transport=transport)
        self.decisions: list[Decision] = []

    # --- what runs where ------------------------------------------------------------------
    def instances(self) -> list[dict[str, Any]]:
        """The router's instances; needs the admin token (others see no instance list)."""
        r = self._http.get("/health")
        body = r.json()
        if "instances" not in body:
            raise LocalActionError(f"the router's /health lists no instances (HTTP {r.status_code}): "
                                   "is the admin token right?")
        return list(body["instances"])

    def roles(self, instances: list[dict[str, Any]] | None = None) -> dict[str, InstanceType]:
        out = {}
        for inst in self.instances() if instances is None else instances:
            if inst.get("role") in InstanceType.__members__:
                out[_id(inst)] = InstanceType(inst["role"])
        return out

    def counts(self, instances: list[dict[str, Any]] | None = None) -> dict[InstanceType, int]:
        out: dict[InstanceType, int] = {}
        for kind in self.roles(instances).values():
            out[kind] = out.get(kind, 0) + 1
        return out

    # --- the Connector protocol -----------------------------------------------------------
    def switch_role(self, instance: str, role: InstanceType | str) -> None:
        value = role.value if isinstance(role, InstanceType) else role
        try:
            r = self._http.post("/admin/role", json={"instance": instance, "role": value})
        except httpx.HTTPError as e:
            raise LocalActionError(f"POST /admin/role {instance} -> {value}: {type(e).__name__}: {e}") from e
        if r.status_code != 200:
            raise LocalActionError(f"POST /admin/role {instance} -> {value}: HTTP {r.status_code}: {r.text[:200]}")

    def set_replicas(self, kind: InstanceType, n: int) -> None:
        instances = self.instances()
        mine = [i for i in instances if i.get("role") == kind.value]
        if n > len(mine):
            # a V standby is a parked video decoder; an engine standby is anything else
            standby = [i for i in instances if i.get("role") == UNASSIGNED and i.get("ready")
                       and bool(i.get("video")) == (kind is InstanceType.V)][:n - len(mine)]
            missing = n - len(mine) - len(standby)
            if missing and self.spawner is None:
                raise LocalActionError(f"{kind.value} to {n} needs {n - len(mine)} standby instance(s), "
                                       f"{len(standby)} ready (serve --autoscale-"
                                       f"{'video-' if kind is InstanceType.V else ''}standby), and this "
                                       "planner starts no processes (no --spawn-spec)")
            for inst in standby:
                self.switch_role(_id(inst), kind)
            for _ in range(missing):
                self.spawn(kind)
        # the ones this planner started go first: stopping them frees their CPU and memory
        started = self.spawner.owns if self.spawner is not None else (lambda _: False)
        for inst in sorted(mine, key=lambda i: (not started(_id(i)), _load(i)))[:max(0, len(mine) - n)]:
            if started(_id(inst)):
                self.retire(_id(inst))
            else:
                self.switch_role(_id(inst), UNASSIGNED)

    def spawn(self, kind: InstanceType) -> str:
        """Start an instance process of `kind` and register it with the router: its id."""
        assert self.spawner is not None
        try:
            instance_id, url = self.spawner.start(kind)
        except Exception as e:  # a StartupError, or the process could not be started at all
            raise LocalActionError(f"starting a {kind.value} instance failed: {e}") from e
        try:
            r = self._http.post("/admin/instances", json={"url": url})
            failure = None if r.status_code == 200 else f"HTTP {r.status_code}: {r.text[:200]}"
        except httpx.HTTPError as e:
            failure = f"{type(e).__name__}: {e}"
        if failure is not None:
            self.spawner.stop(instance_id)
            raise LocalActionError(f"the router did not take the new instance {instance_id}: {failure}")
        return instance_id

    def retire(self, instance_id: str) -> None:
        """The router forgets a started instance, then it drains and exits."""
        assert self.spawner is not None
        try:
            r = self._http.delete(f"/admin/instances/{instance_id}")
        except httpx.HTTPError as e:
            raise LocalActionError(f"DELETE /admin/instances/{instance_id}: {type(e).__name__}: {e}") from e
        if r.status_code not in (200, 404):  # 404: the router had forgotten it already
            raise LocalActionError(f"DELETE /admin/instances/{instance_id}: HTTP {r.status_code}: {r.text[:200]}")
        self.spawner.stop(instance_id)

    def record(self, decision: Decision) -> None:
        self.decisions.append(decision)

    # --- one decision ---------------------------------------------------------------------
    def act(self, decision: Decision) -> str | None:
        """Carry out the decision (not a dry run, not `none`); returns an error or None. A
        switch moves the least-loaded instance of the source type."""
        self.record(decision)
        if decision.action == "none" or decision.dry_run:
            return None
        try:
            if decision.action == "switch_role":
                assert decision.from_type is not None and decision.to_type is not None
                candidates = [i for i in self.instances() if i.get("role") == decision.from_type.value]
                if not candidates:
                    raise LocalActionError(f"no {decision.from_type.value} instance to switch")
                self.switch_role(_id(min(candidates, key=_load)), decision.to_type)
            elif decision.action == "scale":
                assert decision.scale_type is not None
                have = self.counts().get(decision.scale_type, 0)
                self.set_replicas(decision.scale_type, have + decision.delta)
        except (LocalActionError, httpx.HTTPError) as e:
            return str(e)
        return None

    def close(self) -> None:
        """Stop the instances this planner started (they drain), then the HTTP client."""
        try:
            for instance_id in list(self.spawner.running) if self.spawner is not None else []:
                try:
                    self._http.delete(f"/admin/instances/{instance_id}")
                except httpx.HTTPError:
                    pass  # the router may be gone already (serve stops it after the planner)
            if self.spawner is not None:
                self.spawner.close()
        finally:
            self._http.close()


def _id(inst: dict[str, Any]) -> str:
    return str(inst.get("instance_id") or inst["url"])


def _load(inst: dict[str, Any]) -> tuple[float, str]:
    return (float(inst.get("load") or 0.0), _id(inst))
