"""Which worker instances exist, what role each serves now, and how loaded it is.

Discovery hands the registry a list of worker URLs (a static list in local mode, the pods
of the deployment on Kubernetes); the registry confirms each one's role and load from its
own `/health`, so a role switch is seen without a restart.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import httpx

from triptych.topology import InstanceType, Stage

log = logging.getLogger("triptych.router.registry")


@dataclass
class Instance:
    url: str
    role: InstanceType | None = None  # None: unassigned or not yet seen
    ready: bool = False
    draining: bool = False
    load: float = 0.0  # queued work reported by the worker (tokens + images)
    failures: int = 0
    instance_id: str = ""
    inflight: int = 0  # requests this router has on it now
    switching_to: str | None = None  # the role it is switching to (offload -> migrate -> onload)
    # Bumped when a switch starts or ends: a probe answered across that moment describes the
    # instance as it was and is dropped (a slow answer must not put back the old role).
    epoch: int = 0
    block_size: int = 16  # its KV block size: prompts are hashed into blocks of it (prefix routing)
    video: bool = False  # a video decoder process (V, or a parked V standby reporting `unassigned`)

    def can_run(self, stage: Stage) -> bool:
        return self.ready and not self.draining and self.role is not None and self.role.runs(stage)

    @property
    def decodes_video(self) -> bool:
        """A ready V instance (video decode; runs no E/P/D stage)."""
        return self.ready and not self.draining and self.role is InstanceType.V


@dataclass
class Registry:
    urls: list[str]
    poll_interval_s: float = 1.0
    timeout_s: float = 2.0
    instances: dict[str, Instance] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.set_urls(self.urls)

    def set_urls(self, urls: list[str]) -> None:
        """Replace the discovered set (pods come and go); known instances keep their state."""
        self.urls = list(urls)
        self.instances = {u: self.instances.get(u) or Instance(url=u) for u in self.urls}

    def capable(self, stage: Stage, exclude: set[str] = frozenset()) -> list[Instance]:
        return [i for i in self.instances.values() if i.can_run(stage) and i.url not in exclude]

    def video_decoders(self, exclude: set[str] | frozenset[str] = frozenset()) -> list[Instance]:
        return sorted((i for i in self.instances.values() if i.decodes_video and i.url not in exclude),
                      key=lambda i: i.url)

    def roles_summary(self) -> dict[str, dict[str, int]]:
        summary: dict[str, dict[str, int]] = {}
        for inst in self.instances.values():
            key = inst.role.value if inst.role else "unassigned"
            entry = summary.setdefault(key, {"ready": 0, "total": 0})
            entry["total"] += 1
            entry["ready"] += int(inst.ready and not inst.draining)
        return summary

    async def refresh(self, client: httpx.AsyncClient) -> None:
        await asyncio.gather(*(self._probe(client, inst) for inst in list(self.instances.values())))

    async def refresh_one(self, client: httpx.AsyncClient, inst: Instance) -> None:
        await self._probe(client, inst)

    async def _probe(self, client: httpx.AsyncClient, inst: Instance) -> None:
        epoch = inst.epoch
        try:
            resp = await client.get(f"{inst.url}/health", timeout=self.timeout_s)
            body = resp.json()
            if inst.epoch != epoch:
                return
            role = body.get("role")
            inst.role = InstanceType(role) if role in InstanceType.__members__ else None
            inst.ready = resp.status_code == 200 and body.get("status") == "ok"
            inst.switching_to = body.get("target_role") if body.get("status") == "switching" else None
            inst.draining = bool(body.get("draining", False))
            inst.load = float(body.get("load", 0.0))
            inst.instance_id = str(body.get("instance_id", ""))
            inst.block_size = max(1, int(body.get("block_size", inst.block_size)))
            inst.video = bool(body.get("video", False))
            inst.failures = 0
        except (httpx.HTTPError, ValueError) as exc:
            if inst.epoch != epoch:
                return
            inst.failures += 1
            inst.ready = False
            log.debug("health probe of %s failed: %s", inst.url, exc)

    def by_instance_id(self, instance_id: str) -> Instance | None:
        return next((i for i in self.instances.values() if i.instance_id == instance_id), None)

    def mark_switching(self, url: str, role: str | None) -> None:
        """Out of rotation while it switches (at once, not at the next probe); `None` when
        the switch is over (the next probe says what it serves)."""
        inst = self.instances.get(url)
        if inst is not None:
            inst.switching_to = role
            inst.ready = inst.ready and role is None
            inst.epoch += 1

    def mark_failed(self, url: str) -> None:
        """Take an instance out of rotation until its next successful probe."""
        inst = self.instances.get(url)
        if inst is not None:
            inst.ready = False
            inst.failures += 1

    async def run(self, client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.refresh(client)
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.poll_interval_s)
            except TimeoutError:
                pass
