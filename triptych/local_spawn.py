"""Instance processes started and stopped while a local deployment serves: the local
planner's encoder and V scaling (operator/planner/local_connector.py), the local
counterpart of a Deployment's replicas.

`triptych serve --autoscale` writes a SpawnSpec, how it started its own instances (model,
dtype, worker flags, tokens, CPU quota), to a 0600 file beside the admin token and hands
the planner its path. The planner's InstanceSpawner starts an instance the same way, waits
for its `/ready`, and stops it with SIGTERM, on which the worker drains: it finishes or
hands on its work before it exits. The spawned processes are the planner's children and
get SIGTERM if the planner dies, so none outlives the deployment.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from pydantic import BaseModel, Field

from triptych.local import STOP_TIMEOUT_S, LocalDeployment, Process, write_private
from triptych.topology import InstanceType


class SpawnSpec(BaseModel):
    model: str
    host: str = "127.0.0.1"
    dtype: str = "float32"
    transfer_require: str = "any"
    worker_args: list[str] = Field(default_factory=list)
    instance_cpus: float | None = None
    cpu_period_ms: float | None = None
    cpu_priority: float = 1.0
    log_dir: str | None = None
    startup_timeout_s: float = 180.0
    threads: int = 1  # torch threads per instance, as the deployment's own
    internal_token: str = Field(repr=False)
    admin_token: str = Field(repr=False)

    @classmethod
    def of(cls, deployment: LocalDeployment) -> SpawnSpec:
        d = deployment
        return cls(model=str(d.model), host=d.host, dtype=d.dtype, transfer_require=d.transfer_require,
                   worker_args=list(d.worker_args), instance_cpus=d.instance_cpus, cpu_period_ms=d.cpu_period_ms,
                   cpu_priority=d.cpu_priority, log_dir=str(d.log_dir) if d.log_dir else None,
                   startup_timeout_s=d.startup_timeout_s, threads=d.threads_per_instance(), internal_token=d.internal_token,
                   admin_token=d.admin_token)

    def write(self, path: Path) -> None:
        """Owner-only: it holds the deployment's tokens."""
        write_private(path, self.model_dump_json())

    @classmethod
    def read(cls, path: Path | str) -> SpawnSpec:
        return cls.model_validate_json(Path(path).read_text())


class InstanceSpawner:
    """Starts instances like the deployment's own (ids `<type>-a<n>`) and stops them."""

    def __init__(self, spec: SpawnSpec, stop_timeout_s: float = STOP_TIMEOUT_S) -> None:
        self._deployment = LocalDeployment(
            model=Path(spec.model), topology={}, host=spec.host, transfer_require=spec.transfer_require,
            dtype=spec.dtype, worker_args=list(spec.worker_args), startup_timeout_s=spec.startup_timeout_s,
            log_dir=Path(spec.log_dir) if spec.log_dir else None, instance_cpus=spec.instance_cpus,
            cpu_priority=spec.cpu_priority, cpu_period_ms=spec.cpu_period_ms, internal_token=spec.internal_token,
            admin_token=spec.admin_token, die_with_parent=True, threads=spec.threads)
        self.stop_timeout_s = stop_timeout_s
        self.running: dict[str, Process] = {}  # instance id -> its process
        self._started = 0

    def start(self, kind: InstanceType) -> tuple[str, str]:
        """Start one instance of `kind` and wait until it is ready: (instance id, URL)."""
        index = f"a{self._started}"
        self._started += 1
        dep = self._deployment
        dep.open_quota()
        proc = dep.start_worker(kind.value, index)
        try:
            dep.wait_ready([proc])
        except BaseException:
            _kill(proc)
            raise
        instance_id = f"{kind.value}-{index}"
        self.running[instance_id] = proc
        return instance_id, proc.url

    def owns(self, instance_id: str) -> bool:
        return instance_id in self.running

    def stop(self, instance_id: str) -> int | None:
        """SIGTERM (the worker drains), then wait; killed past the timeout. Its exit code."""
        proc = self.running.pop(instance_id)
        if proc.popen.poll() is None:
            proc.popen.send_signal(signal.SIGTERM)
        try:
            return proc.popen.wait(timeout=self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            _kill(proc)
            return proc.popen.returncode

    def close(self) -> None:
        """Stop every spawned instance (all drain at once) and remove their CPU groups."""
        dep = self._deployment
        dep.processes = list(self.running.values())
        self.running.clear()
        dep.stop(timeout_s=self.stop_timeout_s)


def _kill(proc: Process) -> None:
    if proc.popen.poll() is None:
        proc.popen.kill()
    proc.popen.wait(timeout=10)
