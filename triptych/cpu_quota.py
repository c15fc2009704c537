"""A fixed CPU share per local instance: one cgroup per instance with a CPU quota.

On a GPU cluster an instance owns its accelerator; in a local deployment all instances
share the machine's cores, so an idle instance speeds up its neighbours and moving a role
moves no capacity. `triptych serve --instance-cpus X` puts every instance process in its
own group `triptych-<deployment-id>-<instance>` whose quota is X CPUs:

- cgroup v2 (a `cgroup.controllers` listing `cpu` at the root): `cpu.max` = "quota period",
  with `+cpu` enabled in the root's `cgroup.subtree_control`;
- cgroup v1 (a `cpu` hierarchy mounted at <root>/cpu): `cpu.cfs_period_us` and
  `cpu.cfs_quota_us`.

A quota is a ceiling, not a guarantee: on an oversubscribed machine a group gets less,
by weight. The groups are flat (directly under the root), not nested under a deployment
group: siblings in a common parent split the parent's weight among those that are
runnable, so an idle instance's weight would flow to its busy neighbours -- the very
coupling the quotas remove. Each group weighs its share in CPUs times the default weight
of one task (v1 `cpu.shares` 1024 per CPU, v2 `cpu.weight` 100 per CPU): under
contention it competes like X busy processes, whatever its neighbours do. On a machine
oversubscribed by other processes that is less than X; `priority` K > 1 multiplies the
weight (opt-in: the instances then take CPU from other processes, up to their quotas).

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
from dataclasses import dataclass
from pathlib import Path

DEFAULT_ROOT = Path("/sys/fs/cgroup")
TOP = "triptych"
PERIOD_US = 100_000  # the kernel's default CFS period
# A short period (`period_us`) makes a capped instance a uniformly slower device: under
# the default 100 ms, an instance at 0.25 CPU runs flat out for 25 ms and then stalls for
# 75 ms, so a request of a few ms of work finishes at once or 75 ms later depending on
# where in the period it lands; its latency then measures the period's phase, not the
# instance's capacity (the simulator validation's p90s were that noise). At 10 ms the
# stalls are 7.5 ms and a request's work spans several periods.
MIN_PERIOD_US, MAX_PERIOD_US = 1_000, 1_000_000
MIN_QUOTA_US = 1_000  # the kernel refuses cfs quotas under 1 ms
# Control files we write. On cgroupfs they come and go with the directory; on an ordinary
# directory (a stand-in tree in tests) they are plain files that must go before rmdir.
_WRITTEN = ("cpu.max", "cpu.weight", "cpu.cfs_quota_us", "cpu.cfs_period_us", "cpu.shares",
            "cgroup.procs", "cgroup.subtree_control")
_STALE = re.compile(rf"^{TOP}-(\d+)-[0-9a-f]+-")


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


def quota_us(cpus: float, period_us: int = PERIOD_US) -> int:
    if not cpus > 0 or math.isinf(cpus):
        raise ValueError(f"a CPU share must be a positive number of CPUs, got {cpus}")
    return max(MIN_QUOTA_US, round(cpus * period_us))


def check_period_us(period_us: int, cpus: float | None = None) -> int:
    """A CFS period the kernel takes (1 ms - 1 s) whose quota at `cpus` is not raised to
    the 1 ms floor (which would grant more than `cpus`)."""
    if not MIN_PERIOD_US <= period_us <= MAX_PERIOD_US:
        raise ValueError(f"a quota period must be {MIN_PERIOD_US // 1000}-{MAX_PERIOD_US // 1000} ms, "
                         f"got {period_us / 1000:g} ms")
    if cpus is not None and cpus * period_us < MIN_QUOTA_US:
        raise ValueError(f"a period of {period_us / 1000:g} ms gives {cpus:g} CPUs a quota under the "
                         f"kernel's 1 ms floor; use at least {math.ceil(MIN_QUOTA_US / cpus / 1000)} ms")
    return period_us


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
    """The groups of one local deployment: `<base>/triptych-<deployment_id>-<instance>`."""

    layout: Layout
    deployment_id: str
    priority: float = 1.0  # weight multiplier: >1 lets the quota, not other load, bound a group
    period_us: int = PERIOD_US  # the CFS period each group's quota is granted per

    @property
    def prefix(self) -> str:
        return f"{TOP}-{self.deployment_id}-"

    @classmethod
    def create(cls, deployment_id: str | None = None, root: Path | None = None,
               priority: float = 1.0, period_us: int = PERIOD_US) -> DeploymentGroups:
        if not 0 < priority < math.inf:
            raise ValueError(f"priority must be a positive number, got {priority}")
        check_period_us(period_us)
        layout = detect(root)
        groups = cls(layout, deployment_id or new_deployment_id(), priority, period_us)
        if layout.version == 2:
            _write(layout.base / "cgroup.subtree_control", "+cpu")
        groups.sweep_stale()
        return groups

    def group(self, instance: str) -> Path:
        return self.layout.base / (self.prefix + instance)

    def instances(self) -> list[str]:
        try:
            names = [p.name for p in self.layout.base.iterdir() if p.is_dir()]
        except OSError:
            return []
        return sorted(n[len(self.prefix):] for n in names if n.startswith(self.prefix))

    def add_instance(self, instance: str, cpus: float) -> Path:
        """Create (or reuse) the group of `instance` with a quota of `cpus` CPUs."""
        path = self.group(instance)
        try:
            path.mkdir(exist_ok=True)
        except OSError as exc:
            raise QuotaUnavailable(f"cannot create {path}: {exc.strerror or exc}") from exc
        quota = quota_us(cpus, self.period_us)
        if self.layout.version == 2:
            _write(path / "cpu.max", f"{quota} {self.period_us}")
            _write(path / "cpu.weight", str(min(10_000, max(1, round(100 * cpus * self.priority)))))
        else:
            _write(path / "cpu.cfs_period_us", str(self.period_us))
            _write(path / "cpu.cfs_quota_us", str(quota))
            _write(path / "cpu.shares", str(min(262_144, max(2, round(1024 * cpus * self.priority)))))
        return path

    def add_uncapped(self, name: str, cpus: float = 1.0) -> Path:
        """A group with no quota that weighs like `cpus` busy CPUs times the priority: for
        the router, which the model of a deployment treats as latency, not capacity. On a
        machine loaded by other processes it would otherwise wait behind them (at the
        default weight) while the instances it feeds are protected by theirs."""
        path = self.group(name)
        try:
            path.mkdir(exist_ok=True)
        except OSError as exc:
            raise QuotaUnavailable(f"cannot create {path}: {exc.strerror or exc}") from exc
        if self.layout.version == 2:
            _write(path / "cpu.max", f"max {self.period_us}")
            _write(path / "cpu.weight", str(min(10_000, max(1, round(100 * cpus * self.priority)))))
        else:
            _write(path / "cpu.cfs_quota_us", "-1")
            _write(path / "cpu.shares", str(min(262_144, max(2, round(1024 * cpus * self.priority)))))
        return path

    def move(self, pid: int, instance: str) -> None:
        """Put process `pid` (every thread of it) in the group of `instance`."""
        _write(self.group(instance) / "cgroup.procs", str(pid))

    def cpu_stat(self, instance: str) -> dict[str, int]:
        """The group's throttling counters (`nr_periods`, `nr_throttled`, and the time
        throttled as `throttled_us`): whether the quota, rather than other load, held it back."""
        try:
            text = (self.group(instance) / "cpu.stat").read_text()
        except OSError:
            return {}
        raw = dict((k, int(v)) for k, v in (line.split()[:2] for line in text.splitlines() if line.strip()))
        out = {k: raw[k] for k in ("nr_periods", "nr_throttled") if k in raw}
        if "throttled_usec" in raw:  # v2
            out["throttled_us"] = raw["throttled_usec"]
        elif "throttled_time" in raw:  # v1: nanoseconds
            out["throttled_us"] = raw["throttled_time"] // 1000
        return out

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
        """Kill what is still inside (a process an instance left behind) and remove every
        group of this deployment. Returns the groups that could not be removed (empty when
        all went)."""
        left: list[Path] = []
        for instance in self.instances():
            for pid in self.pids(instance):
                if self._member(pid, instance):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            if not _rmdir(self.group(instance), timeout_s):
                left.append(self.group(instance))
        return left

    def sweep_stale(self) -> None:
        """Remove empty groups of deployments whose owner process is gone (a `serve`
        killed with SIGKILL could not clean up)."""
        for child in self.layout.base.iterdir():
            match = _STALE.match(child.name)
            if child.is_dir() and match and not _pid_alive(int(match.group(1))):
                _rmdir(child, 0)
