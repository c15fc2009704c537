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

# Failed health probes in a row after which an instance that said it was switching is no
# longer taken to be (requests stop waiting for it to come back).
DEAD_AFTER_FAILURES = 3


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
    # Set (and replaced) whenever an instance's rotation state changes — back from a switch,
    # a role seen anew, ready again: requests waiting for an instance (`wait_for_change`)
    # wake on it instead of polling.
    _changed: asyncio.Event | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.set_urls(self.urls)

    def switching(self, stage: Stage, exclude: set[str] | frozenset[str] = frozenset()) -> list[Instance]:
        """Instances out of rotation for a while only — mid-switch — that ran `stage`
        before it or will after it (a switch that fails keeps the old role)."""
        return [i for i in self.instances.values() if i.switching_to is not None and i.url not in exclude
                and ((i.role is not None and i.role.runs(stage))
                     or (i.switching_to in InstanceType.__members__ and InstanceType(i.switching_to).runs(stage)))]

    def recovering(self, stage: Stage, exclude: set[str] | frozenset[str] = frozenset()) -> list[Instance]:
        """Instances of `stage` out of rotation after a failed probe or a broken stream but
        not given up on (fewer than DEAD_AFTER_FAILURES failures in a row): under overload
        one slow answer takes an instance out until its next good probe, and a request that
        needs it is better held until then than failed (bounded, as for a switch)."""
        return [i for i in self.instances.values() if not i.ready and not i.draining and i.url not in exclude
                and 0 < i.failures < DEAD_AFTER_FAILURES and i.role is not None and i.role.runs(stage)]

    async def wait_for_change(self, timeout_s: float) -> bool:
        """Wait until an instance's rotation state changes (True), or `timeout_s` (False)."""
        if self._changed is None:
            self._changed = asyncio.Event()
        try:
            await asyncio.wait_for(self._changed.wait(), max(0.0, timeout_s))
            return True
        except TimeoutError:
            return False

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None  # the next waiter waits for the next change

    def set_urls(self, urls: list[str]) -> None:
        """Replace the discovered set (pods come and go); known instances keep their state."""
        self.urls = list(urls)
        self.instances = {u: self.instances.get(u) or Instance(url=u) for u in self.urls}

    def add_url(self, url: str) -> Instance:
        """Register one more instance (`POST /admin/instances`: a process started later)."""
        if url not in self.instances:
            self.urls.append(url)
            self.instances[url] = Instance(url=url)
        return self.instances[url]

    def remove_url(self, url: str) -> None:
        """Forget an instance: no new work goes there. Requests already on it keep their
        connections (they hold the instance, not the registry entry)."""
        if url in self.instances:
            self.urls.remove(url)
            del self.instances[url]
            self._notify()

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

    async def switch_ended(self, client: httpx.AsyncClient, url: str) -> None:
        """A switch through the router is over: drop probes answered during it, and let a
        fresh probe say what the instance serves now — it stays marked switching until
        then, so requests waiting for its role keep waiting rather than fail in between."""
        inst = self.instances.get(url)
        if inst is None:
            return
        inst.epoch += 1
        if not await self._probe(client, inst):
            inst.switching_to = None  # no answer: what it serves is unknown, not "soon"
            self._notify()

    async def _probe(self, client: httpx.AsyncClient, inst: Instance) -> bool:
        """Update `inst` from its /health; False when it did not answer."""
        epoch = inst.epoch
        try:
            resp = await client.get(f"{inst.url}/health", timeout=self.timeout_s)
            body = resp.json()
            if inst.epoch != epoch:
                return True
            was = _rotation(inst)
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
            if _rotation(inst) != was:
                self._notify()
            return True
        except (httpx.HTTPError, ValueError) as exc:
            if inst.epoch != epoch:
                return False
            inst.failures += 1
            inst.ready = False
            if inst.failures >= DEAD_AFTER_FAILURES:
                inst.switching_to = None  # not answering: no longer known to be mid-switch
            if inst.failures == DEAD_AFTER_FAILURES:
                self._notify()  # given up on: requests held for it (`recovering`) stop waiting
            log.debug("health probe of %s failed: %s", inst.url, exc)
            return False

    def by_instance_id(self, instance_id: str) -> Instance | None:
        return next((i for i in self.instances.values() if i.instance_id == instance_id), None)

    def mark_switching(self, url: str, role: str | None) -> None:
        """Out of rotation while it switches (at once, not at the next probe); `None` when
        the switch is over (the next probe says what it serves; `switch_ended` probes)."""
        inst = self.instances.get(url)
        if inst is not None:
            inst.switching_to = role
            inst.ready = inst.ready and role is None
            inst.epoch += 1
            self._notify()

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


def _rotation(inst: Instance) -> tuple[object, ...]:
    """What routing sees of an instance: a change of it wakes the waiters."""
    return inst.ready, inst.draining, inst.role, inst.switching_to
