"""Local mode: `triptych serve` runs the router and the instances as local processes.

The same code paths as on Kubernetes (one worker process per instance, real HTTP and
real NIXL between them), with static discovery instead of a pod watch.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from triptych.cli_args import resolve_model
from triptych.cpu_binding import (
    BindingUnavailable,
    CpuBinding,
    available_cpus,
    bind_current_thread,
    format_cpu_list,
    plan,
)
from triptych.cpu_quota import PERIOD_US, DeploymentGroups, QuotaUnavailable, check_period_us, threads_for
from triptych.http_ready import answers_ok
from triptych.listen_socket import reserve
from triptych.topology import UNASSIGNED, InstanceType, parse_topology

log = logging.getLogger("triptych.local")
INTERNAL_TOKEN_ENV = "TRIPTYCH_INTERNAL_TOKEN"
ADMIN_TOKEN_ENV = "TRIPTYCH_ADMIN_TOKEN"
# A drained worker exits once its work is finished or handed on (worker --drain-timeout,
# 60 s by default); an instance stopped on its own (local_spawn.py) is killed past this.
STOP_TIMEOUT_S = 90.0


def admin_token_for_serve(path: str | None) -> tuple[str, Path | None]:
    """`triptych serve`'s admin token: from `path`, else TRIPTYCH_ADMIN_TOKEN, else a fresh
    one written (mode 0600) to ~/.cache/triptych/admin-token; returns it and where it
    was written (None when the user gave it)."""
    if path:
        return Path(path).read_text().strip(), None
    if os.environ.get(ADMIN_TOKEN_ENV, "").strip():
        return os.environ[ADMIN_TOKEN_ENV].strip(), None
    token = secrets.token_urlsafe(32)
    out = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "triptych" / "admin-token"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_private(out, token + "\n")
    return token, out


def write_private(path: Path, text: str) -> None:
    """Write a secret owner-only (0600) from its first byte."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)  # an existing file keeps its mode through O_CREAT


class StartupError(RuntimeError):
    """A process of the local deployment exited or did not become ready in time."""


_HANDED_OUT: set[int] = set()  # ports free_port gave out in this process
_PORT_LOCK = threading.Lock()


def _without_listen(args: list[str]) -> list[str]:
    """A process's arguments less its --port and --fd (and their values)."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in ("--port", "--fd"):
            skip = True
        else:
            out.append(arg)
    return out


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now that this process has not handed out before (for processes that bind
    it themselves; local deployments hand theirs a bound socket, listen_socket.py). The kernel may offer a
    port again as soon as the probe closes it, and a child given a port binds it only after
    loading its model: two instances started one after the other got the same port (the
    second failed to bind, and the first answered the second's readiness probe)."""
    with _PORT_LOCK:
        for _ in range(1000):
            with socket.socket() as sock:
                sock.bind((host, 0))
                port = sock.getsockname()[1]
            if port not in _HANDED_OUT:
                _HANDED_OUT.add(port)
                return port
    raise OSError(f"no free port on {host} that was not handed out already")


@dataclass
class Process:
    name: str
    url: str
    popen: subprocess.Popen[bytes]
    ready_path: str = "/ready"  # an unassigned worker is never ready: its start waits on /live


@dataclass
class LocalDeployment:
    """Starts instances and a router as child processes; a context manager for tests too."""

    model: Path
    topology: dict[InstanceType, int]
    host: str = "127.0.0.1"
    port: int = 0
    transfer_require: str = "any"
    # Beside the topology, e.g. ["unassigned"] (engine standbys) or ["V"]: a video decoder
    # started parked (a standby the planner's V scaling un-parks; local_connector.py).
    extra_roles: list[str] = field(default_factory=list)
    dtype: str = "float32"  # every instance's weights, activations and KV cache (worker --dtype)
    worker_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    startup_timeout_s: float = 180.0
    log_dir: Path | None = None
    instance_cpus: float | None = None  # CPU quota per instance (cgroup); None: share the machine
    cpu_priority: float = 1.0  # weight of a capped instance per CPU of quota, in busy tasks
    cpu_period_ms: float | None = None  # the quota's CFS period (None: the kernel's 100 ms; cpu_quota.py)
    # Children get SIGTERM when this process dies (Linux PR_SET_PDEATHSIG): for a starter
    # whose spawning thread lives as long as it (the planner's; local_spawn.py).
    die_with_parent: bool = False
    threads: int | None = None  # torch threads per instance (None: from the quota or the core count)
    # Each engine on cores of its own, the router and the workers' other threads on the rest,
    # where they fit (cpu_binding.py; never with quotas: those share the cores by time).
    cpu_binding: bool = False
    binding: CpuBinding | None = None
    binding_error: str | None = None  # why cpu_binding runs unbound
    processes: list[Process] = field(default_factory=list)
    quota: DeploymentGroups | None = None  # the instances' cgroups, while running with quotas
    quota_error: str | None = None  # why --instance-cpus runs without quotas
    # Workers' /internal token (fresh per deployment, only the children get it) and the
    # /admin token (TRIPTYCH_ADMIN_TOKEN if set); both reach the children by environment.
    internal_token: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)
    admin_token: str = field(default_factory=lambda: os.environ.get(ADMIN_TOKEN_ENV, "").strip()
                             or secrets.token_urlsafe(32), repr=False)

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.admin_token}"}

    @property
    def internal_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.internal_token}"}

    @property
    def router_url(self) -> str:
        return self.processes[-1].url

    @property
    def workers(self) -> list[Process]:
        return self.processes[:-1]

    def threads_per_instance(self) -> int:
        if self.threads is not None:
            return self.threads
        if self.instance_cpus is not None:  # as many threads as the share has CPUs
            return threads_for(self.instance_cpus)
        # One core is left to the router and the clients (vLLM's CPU backend reserves one
        # too): with every core in its OpenMP regions, an engine stalls at the regions'
        # barriers whenever the router takes a core, and on 2 cores serving kept 0.50-0.58
        # of a 2-thread engine but 0.81-0.86 of a 1-thread one, which served more
        # (docs/benchmarks.md).
        instances = sum(self.topology.values()) + len(self.extra_roles)
        return max(1, (os.cpu_count() or 1) - 1) // max(1, instances) or 1

    def instance_quotas(self) -> dict[str, float | None]:
        """CPUs each instance is capped at (None: no quota), by process name."""
        capped = self.quota is not None
        return {p.name: self.instance_cpus if capped else None for p in self.workers}

    def _instance_names(self) -> list[str]:
        return ([f"worker-{kind}-{i}" for kind, n in self.topology.items() for i in range(n)]
                + [f"worker-{role}-{_extra_index(role, i)}" for i, role in enumerate(self.extra_roles)])

    def open_quota(self) -> None:
        """Create every instance's cgroup, or say plainly why there will be none."""
        if self.instance_cpus is None or self.quota is not None:
            return
        if not self.instance_cpus > 0:
            raise ValueError(f"--instance-cpus must be > 0, got {self.instance_cpus}")
        groups = None
        try:
            period = round(self.cpu_period_ms * 1000) if self.cpu_period_ms else PERIOD_US
            check_period_us(period, self.instance_cpus)
            groups = DeploymentGroups.create(priority=self.cpu_priority, period_us=period)
            for name in self._instance_names():
                groups.add_instance(name, self.instance_cpus)
            self.quota = groups
        except QuotaUnavailable as exc:
            if groups is not None:
                groups.remove()
            self.quota_error = str(exc)
            print(f"triptych: --instance-cpus {self.instance_cpus:g}: cannot set a CPU quota ({exc}); "
                  f"running WITHOUT quotas (instances share every core; threads still "
                  f"{self.threads_per_instance()} each)", file=sys.stderr, flush=True)

    def plan_binding(self) -> None:
        """Bind where every instance gets its own cores and one is left (cpu_binding.py);
        else say why and run unbound."""
        if not self.cpu_binding or self.binding is not None:
            return
        if self.instance_cpus is not None:
            self.binding_error = "--instance-cpus shares the cores out by quota"
            print(f"triptych: CPU binding off: {self.binding_error}", file=sys.stderr, flush=True)
            return
        try:
            self.binding = plan(available_cpus(), self._instance_names(), self.threads_per_instance())
        except BindingUnavailable as exc:
            self.binding_error = str(exc)
            print(f"triptych: CPU binding off: {exc}", file=sys.stderr, flush=True)
            return
        print(f"triptych: CPU binding: {self.binding.describe()}", file=sys.stderr, flush=True)

    def _binding_args(self, name: str, kind: InstanceType | str) -> list[str]:
        if self.binding is None or name not in self.binding.engines:
            return []
        cpus = self.binding.engines[name]
        if str(kind) == InstanceType.V.value:  # a video decoder is all service: its own cores throughout
            return ["--service-cpus", format_cpu_list(cpus)]
        return ["--engine-cpus", format_cpu_list(cpus), "--service-cpus", format_cpu_list(self.binding.service)]

    def _preexec_for(self, name: str) -> Callable[[], None] | None:
        """Join the instance's group in the child before exec, so that everything it runs
        or spawns is inside from its first instruction. The router (with a priority above
        1) joins an uncapped group of that weight, so other load does not slow the hops."""
        if self.quota is None or self.instance_cpus is None:
            return None
        try:
            if name == "router":
                if self.cpu_priority <= 1:
                    return None
                procs = self.quota.add_uncapped(name) / "cgroup.procs"
            else:
                procs = self.quota.add_instance(name, self.instance_cpus) / "cgroup.procs"
        except QuotaUnavailable as exc:
            raise StartupError(f"{name}: {exc}") from exc

        def join() -> None:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        return join

    def _spawn(self, name: str, args: list[str], port: int | socket.socket, capped: bool = False) -> Process:
        """Start `triptych <args>` as `name`. `port`: a socket bound for it (listen_socket.py:
        it serves on that one, inherited), or a port number it binds itself."""
        if isinstance(port, socket.socket):
            sock, number = port, port.getsockname()[1]
            try:
                return self._popen(name, [*args, "--port", str(number), "--fd", str(sock.fileno())], number, capped,
                                   (sock.fileno(),))
            finally:
                sock.close()  # the child holds its own copy
        return self._popen(name, [*args, "--port", str(port)], port, capped, ())

    def _popen(self, name: str, args: list[str], port: int, capped: bool, pass_fds: tuple[int, ...]) -> Process:
        env = dict(os.environ)
        threads = str(self.threads_per_instance())
        env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, TRIPTYCH_THREADS=threads)
        env.update({INTERNAL_TOKEN_ENV: self.internal_token, ADMIN_TOKEN_ENV: self.admin_token})
        out = subprocess.DEVNULL
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{name}.log", "wb")
        cmd = [sys.executable, "-m", "triptych.cli", *args]
        preexec = self._preexec_for(name) if capped or name == "router" else None
        if self.binding is not None and not capped:  # the router, the planner: the service CPUs
            preexec = _with_cpus(preexec, self.binding.service)
        if self.die_with_parent:
            preexec = _with_parent_death_signal(preexec)
        popen = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                 preexec_fn=preexec, pass_fds=pass_fds)
        return Process(name=name, url=f"http://{self.host}:{port}", popen=popen)

    def start_worker(self, kind: InstanceType | str, index: int | str, port: int | None = None) -> Process:
        args = ["worker", "--model", str(self.model), "--role", str(kind), "--host", self.host,
                "--instance-id", f"{kind}-{index}",
                "--transfer-require", self.transfer_require, "--dtype", self.dtype, *self.worker_args,
                *self._binding_args(f"worker-{kind}-{index}", kind)]
        proc = self._spawn(f"worker-{kind}-{index}", args, port or reserve(self.host), capped=True)
        if str(kind) == UNASSIGNED:
            proc.ready_path = "/live"
        return proc

    def start(self) -> LocalDeployment:
        if self.processes:  # already running (e.g. started, then used as a context manager)
            return self
        try:
            self.open_quota()
            self.plan_binding()
            workers = [self.start_worker(kind, i) for kind, n in self.topology.items() for i in range(n)]
            standby = [self.start_worker(role, _extra_index(role, i)) for i, role in enumerate(self.extra_roles)]
            workers += standby
            self.processes.extend(workers)
            self.wait_ready(workers)
            for proc, role in zip(standby, self.extra_roles, strict=True):
                if role == InstanceType.V.value:  # parked before the router first sees it
                    r = httpx.post(f"{proc.url}/admin/role", json={"role": UNASSIGNED}, headers=self.admin_headers,
                                   timeout=30)
                    r.raise_for_status()
            router_args = ["router", "--model", str(self.model), "--host", self.host,
                           "--workers", *[w.url for w in workers], *self.router_args]
            router = self._spawn("router", router_args, self.port or reserve(self.host))
            self.processes.append(router)
            self.wait_ready([router])
        except BaseException:
            self.stop()
            raise
        return self

    def restart_worker(self, proc: Process) -> Process:
        """Start a fresh process in place of `proc` (same role and port) and wait until ready."""
        args = _without_listen(list(proc.popen.args[3:]))  # after: python -m triptych.cli
        if proc.popen.poll() is None:
            proc.popen.kill()
            proc.popen.wait(timeout=10)
        port = int(proc.url.rsplit(":", 1)[1])
        fresh = self._spawn(proc.name, args, reserve(self.host, port), capped=proc.name != "router")
        self.processes[self.processes.index(proc)] = fresh
        self.wait_ready([fresh])
        return fresh

    def wait_ready(self, procs: list[Process]) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        pending = list(procs)
        with httpx.Client(timeout=2.0) as client:
            while pending:
                for proc in list(pending):
                    if proc.popen.poll() is not None:
                        raise StartupError(f"{proc.name} exited with code {proc.popen.returncode}")
                    if answers_ok(f"{proc.url}{proc.ready_path}", client=client):
                        pending.remove(proc)
                if pending and time.monotonic() > deadline:
                    names = ", ".join(p.name for p in pending)
                    raise StartupError(f"not ready after {self.startup_timeout_s:.0f}s: {names}")
                if pending:
                    time.sleep(0.2)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM everything (router first, so it stops routing), then SIGKILL stragglers."""
        for proc in reversed(self.processes):
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in self.processes:
            remaining = max(0.1, deadline - time.monotonic())
            try:
                proc.popen.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(timeout=5)
        self.processes.clear()
        if self.quota is not None:
            left = self.quota.remove()
            if left:
                log.error("could not remove cgroups %s", ", ".join(map(str, left)))
            self.quota = None

    def __enter__(self) -> LocalDeployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _with_parent_death_signal(then: Callable[[], None] | None) -> Callable[[], None]:
    def preexec() -> None:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if then is not None:
            then()
    return preexec


def _with_cpus(then: Callable[[], None] | None, cpus: tuple[int, ...]) -> Callable[[], None]:
    def preexec() -> None:
        bind_current_thread(cpus)
        if then is not None:
            then()
    return preexec


def _router_passthrough(args: argparse.Namespace) -> list[str]:
    out: list[str] = []
    if getattr(args, "api_key_file", None):
        out += ["--api-key-file", str(args.api_key_file)]
    if getattr(args, "allow_no_api_key", False):
        out.append("--allow-no-api-key")
    if getattr(args, "no_stage_channel", False):
        out.append("--no-stage-channel")
    return out


def _admin_token_file(token: str) -> Path:
    """The deployment's admin token in a 0600 file, for the planner (`serve --autoscale`)."""
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="triptych-admin-")) / "admin-token"
    write_private(path, token)
    return path


def _extra_index(role: str, i: int) -> int | str:
    """An extra instance's index in its name and instance id: V standbys get `s<i>`, so
    they never collide with the topology's V-0, V-1, ..."""
    return f"s{i}" if role == InstanceType.V.value else i


def start_planner(deployment: LocalDeployment, token_file: Path, port: int, extra: list[str]) -> Process:
    """`triptych autoscale` beside the deployment (operator/planner/local_main.py), with the
    spec to start more instances like the deployment's own (local_spawn.py), 0600 beside
    the admin token."""
    from triptych.local_spawn import SpawnSpec

    spec = token_file.parent / "spawn-spec.json"
    SpawnSpec.of(deployment).write(spec)
    args = ["autoscale", "--router", deployment.router_url, "--admin-token-file", str(token_file),
            "--spawn-spec", str(spec), "--host", deployment.host, *extra]
    return deployment._spawn("planner", args, port)


def cli_main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    admin_token, written = admin_token_for_serve(getattr(args, "admin_token_file", None))
    if written is not None:
        print(f"admin token (for the workers' /admin/* and the router's full /health): {written}", flush=True)
    autoscale = getattr(args, "autoscale", False)
    token_file = _admin_token_file(admin_token) if autoscale else None
    deployment = LocalDeployment(
        admin_token=admin_token,
        model=resolve_model(args.model),
        topology=parse_topology(args.topology),
        host=args.host,
        port=args.port,
        transfer_require=args.transfer_require,
        dtype=getattr(args, "dtype", "float32"),
        router_args=_router_passthrough(args) + (["--admin-token-file", str(token_file)] if token_file else []),
        extra_roles=(["unassigned"] * args.autoscale_standby
                     + [InstanceType.V.value] * getattr(args, "autoscale_video_standby", 0)) if autoscale else [],
        instance_cpus=getattr(args, "instance_cpus", None),
        cpu_period_ms=getattr(args, "instance_cpu_period_ms", None),
        threads=getattr(args, "threads", None),
        cpu_binding=getattr(args, "cpu_binding", "off") == "auto" and not autoscale,
        worker_args=["--stream-interval", str(args.stream_interval)] if getattr(args, "stream_interval", 1) > 1 else [],
    )
    if autoscale and getattr(args, "cpu_binding", "off") == "auto":
        print("triptych: CPU binding off: --autoscale starts and stops instances", file=sys.stderr, flush=True)
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    deployment.start()
    print(f"Triptych is serving {deployment.model.name} ({args.topology}) at {deployment.router_url}/v1",
          flush=True)
    planner = None
    if token_file is not None:
        import shlex

        planner = start_planner(deployment, token_file, args.planner_port, shlex.split(args.autoscale_args))
        print(f"planner: {planner.url}/plan and {planner.url}/metrics", flush=True)
    try:
        while not stopping:
            dead = [p for p in [*deployment.processes, *([planner] if planner else [])] if p.popen.poll() is not None]
            if dead:
                log.error("%s exited with code %s; shutting down", dead[0].name, dead[0].popen.returncode)
                return 1
            time.sleep(0.5)
    finally:
        if planner is not None and planner.popen.poll() is None:
            planner.popen.terminate()
            try:  # it stops the instances it started first; each drains (local_spawn.py)
                planner.popen.wait(timeout=STOP_TIMEOUT_S + 10)
            except subprocess.TimeoutExpired:
                planner.popen.kill()
        deployment.stop()
        if token_file is not None:
            import shutil

            shutil.rmtree(token_file.parent, ignore_errors=True)
    return 0
