"""A fixed CPU share per local instance: one cgroup per instance with a CPU quota.

On a GPU cluster an instance owns its accelerator; in a local deployment all instances
share the machine's cores, so an idle instance speeds up its neighbours and moving a role
moves no capacity. `triptych serve --instance-cpus X` puts every instance process in its
own group `triptych/<deployment-id>/<instance>` whose quota is X CPUs:

- cgroup v2 (a `cgroup.controllers` listing `cpu` at the root): `cpu.max` = "quota period",
  with `+cpu` enabled in `cgroup.subtree_control` of every ancestor we create;
- cgroup v1 (a `cpu` hierarchy mounted at <root>/cpu): `cpu.cfs_period_us` and
  `cpu.cfs_quota_us`.

A quota is a ceiling, not a guarantee: on an oversubscribed machine a group gets less.
So that a group does not get *less* than the same processes ungrouped would (a group at
the top level competes with each other top-level task as one entity), each group's weight
is its share in CPUs times the default weight of one task (v1 `cpu.shares` 1024 per CPU,
v2 `cpu.weight` 100 per CPU), and each ancestor weighs the sum of its children.

The root is /sys/fs/cgroup, or $TRIPTYCH_CGROUP_ROOT (tests point it at a stand-in tree).
Anything that prevents a quota (no cpu controller, not root, read-only) raises
QuotaUnavailable with the reason; the caller says so and runs without quotas.
"""

from __future__ import annotations

import errno
import math
import os
import re
import secrets
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_ROOT = Path("/sys/fs/cgroup")
TOP = "triptych"
PERIOD_US = 100_000
MIN_QUOTA_US = 1_000  # the kernel refuses cfs quotas under 1 ms
# Control files we write. On cgroupfs they come and go with the directory; on an ordinary
# directory (a stand-in tree in tests) they are plain files that must go before rmdir.
_WRITTEN = ("cpu.max", "cpu.weight", "cpu.cfs_quota_us", "cpu.cfs_period_us", "cpu.shares",
            "cgroup.procs", "cgroup.subtree_control")
_DEPLOYMENT_ID = re.compile(r"^(\d+)-[0-9a-f]+$")


class QuotaUnavailable(RuntimeError):
    """No CPU quota can be set here; the message says why."""


def cgroup_root() -> Path:
    return Path(os.environ.get("TRIPTYCH_CGROUP_ROOT") or DEFAULT_ROOT)


@dataclass(frozen=True)
class Layout:
    version: int  # 1 or 2
    base: Path  # the hierarchy holding the cpu controller (v2: the root; v1: <root>/cpu)


def detect(root: Path | None = None) -> Layout:
    """The cgroup hierarchy with a cpu controller under `root`: v2 first, then v1."""
    root = root or cgroup_root()
    controllers = root / "cgroup.controllers"
    if controllers.is_file() and "cpu" in controllers.read_text().split():
        return Layout(2, root)
    for name in ("cpu", "cpu,cpuacct"):
        if (root / name / "cpu.cfs_quota_us").is_file():
            return Layout(1, root / name)
    raise QuotaUnavailable(f"no cpu controller under {root} (neither cgroup v2 with 'cpu' in "
                           f"cgroup.controllers nor a v1 cpu hierarchy with cpu.cfs_quota_us)")


def quota_us(cpus: float) -> int:
    if not cpus > 0 or math.isinf(cpus):
        raise ValueError(f"a CPU share must be a positive number of CPUs, got {cpus}")
    return max(MIN_QUOTA_US, round(cpus * PERIOD_US))


def threads_for(cpus: float) -> int:
    """Torch threads matching a share of `cpus` CPUs: more threads than the quota lets run
    at once only take turns being throttled."""
    return max(1, math.ceil(cpus))


def new_deployment_id() -> str:
    """<our pid>-<random>: the pid lets a later deployment sweep groups whose owner died."""
    return f"{os.getpid()}-{secrets.token_hex(3)}"


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as exc:
        raise QuotaUnavailable(f"cannot write {path}: {exc.strerror or exc}") from exc


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _rmdir(path: Path, timeout_s: float = 5.0) -> bool:
    """Remove a group; retries while the kernel still counts exiting tasks (EBUSY)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno == errno.ENOTEMPTY:  # an ordinary directory: our files, then retry
                try:
                    for name in _WRITTEN:
                        (path / name).unlink(missing_ok=True)
                    os.rmdir(path)
                    return True
                except OSError:
                    return False
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                return False
            time.sleep(0.05)


@dataclass
class DeploymentGroups:
    """The groups of one local deployment: `<base>/triptych/<deployment_id>/<instance>`."""

    layout: Layout
    deployment_id: str
    weights: dict[str, int] = field(default_factory=dict)

    @property
    def top(self) -> Path:
        return self.layout.base / TOP

    @property
    def path(self) -> Path:
        return self.top / self.deployment_id

    @classmethod
    def create(cls, deployment_id: str | None = None, root: Path | None = None) -> DeploymentGroups:
        layout = detect(root)
        groups = cls(layout, deployment_id or new_deployment_id())
        try:
            groups.top.mkdir(exist_ok=True)
            groups.sweep_stale()
            groups.path.mkdir()
        except OSError as exc:
            raise QuotaUnavailable(f"cannot create {groups.path}: {exc.strerror or exc}") from exc
        if layout.version == 2:
            try:
                for parent in (layout.base, groups.top, groups.path):
                    _write(parent / "cgroup.subtree_control", "+cpu")
            except QuotaUnavailable:
                groups.remove()
                raise
        return groups

    def group(self, instance: str) -> Path:
        return self.path / instance

    def add_instance(self, instance: str, cpus: float) -> Path:
        """Create (or reuse) the group of `instance` with a quota of `cpus` CPUs."""
        path = self.group(instance)
        try:
            path.mkdir(exist_ok=True)
        except OSError as exc:
            raise QuotaUnavailable(f"cannot create {path}: {exc.strerror or exc}") from exc
        quota = quota_us(cpus)
        if self.layout.version == 2:
            _write(path / "cpu.max", f"{quota} {PERIOD_US}")
        else:
            _write(path / "cpu.cfs_period_us", str(PERIOD_US))
            _write(path / "cpu.cfs_quota_us", str(quota))
        self.weights[instance] = self._weight(cpus)
        self._set_weight(path, self.weights[instance])
        self._set_weight(self.path, sum(self.weights.values()))
        self._reweigh_top()
        return path

    def _weight(self, cpus: float) -> int:
        if self.layout.version == 2:
            return min(10_000, max(1, round(100 * cpus)))
        return max(2, round(1024 * cpus))

    def _set_weight(self, path: Path, weight: int) -> None:
        name = "cpu.weight" if self.layout.version == 2 else "cpu.shares"
        _write(path / name, str(weight))

    def _reweigh_top(self) -> None:
        """The shared `triptych` group weighs the sum of every deployment's (best effort:
        another deployment may be starting or stopping meanwhile)."""
        name = "cpu.weight" if self.layout.version == 2 else "cpu.shares"
        total = 0
        for child in self.top.iterdir():
            try:
                total += int((child / name).read_text()) if child.is_dir() else 0
            except (OSError, ValueError):
                continue
        if total:
            limit = 10_000 if self.layout.version == 2 else 262_144
            self._set_weight(self.top, min(limit, total))

    def move(self, pid: int, instance: str) -> None:
        """Put process `pid` (every thread of it) in the group of `instance`."""
        _write(self.group(instance) / "cgroup.procs", str(pid))

    def pids(self, instance: str) -> list[int]:
        try:
            text = (self.group(instance) / "cgroup.procs").read_text()
        except OSError:
            return []
        return [int(p) for p in text.split()]

    def _member(self, pid: int, instance: str) -> bool:
        """Whether the kernel says `pid` is in the group (a stand-in tree lists pids that
        are not: never signal those)."""
        rel = "/" + str(self.group(instance).relative_to(self.layout.base))
        try:
            lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        except OSError:
            return False
        for line in lines:
            _, controllers, path = line.split(":", 2)
            wanted = controllers == "" if self.layout.version == 2 else "cpu" in controllers.split(",")
            if wanted and path == rel:
                return True
        return False

    def remove(self, timeout_s: float = 5.0) -> list[Path]:
        """Kill what is still inside (a process an instance left behind), remove every
        group of this deployment, and `triptych/` when it is empty. Returns the groups
        that could not be removed (empty when all went)."""
        left: list[Path] = []
        instances = sorted(p.name for p in self.path.iterdir() if p.is_dir()) if self.path.is_dir() else []
        for instance in instances:
            for pid in self.pids(instance):
                if self._member(pid, instance):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            if not _rmdir(self.group(instance), timeout_s):
                left.append(self.group(instance))
        if not _rmdir(self.path, timeout_s):
            left.append(self.path)
        _rmdir(self.top, 0)  # fails while another deployment holds a group: fine
        return left

    def sweep_stale(self) -> None:
        """Remove empty groups of deployments whose owner process is gone (a `serve`
        killed with SIGKILL could not clean up)."""
        for child in self.top.iterdir():
            match = _DEPLOYMENT_ID.match(child.name)
            if not child.is_dir() or not match or _pid_alive(int(match.group(1))):
                continue
            for sub in child.iterdir():
                if sub.is_dir():
                    _rmdir(sub, 0)
            _rmdir(child, 0)
