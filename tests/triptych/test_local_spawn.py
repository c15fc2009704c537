"""local_spawn.py's pieces that need no model: the spawn spec (what `serve` hands the
planner: everything a started instance needs to match the deployment's own, owner-only,
tokens kept out of reprs) and the parent-death signal that keeps a started instance from
outliving the planner that started it."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from polling import wait_until

from triptych.local import LocalDeployment
from triptych.local_spawn import SpawnSpec
from triptych.topology import InstanceType as T


def test_the_spec_carries_the_deployments_launch_settings_owner_only(tmp_path: Path) -> None:
    dep = LocalDeployment(model=tmp_path / "m", topology={T.E: 1, T.P: 1, T.D: 2}, dtype="bfloat16",
                          transfer_require="nixl", worker_args=["--block-size", "32"], instance_cpus=0.5,
                          cpu_period_ms=10, log_dir=tmp_path / "logs", internal_token="int-tok", admin_token="adm-tok")
    spec = SpawnSpec.of(dep)
    path = tmp_path / "spawn-spec.json"
    spec.write(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    back = SpawnSpec.read(path)
    assert back == spec
    assert (back.model, back.dtype, back.transfer_require, back.worker_args) == (
        str(tmp_path / "m"), "bfloat16", "nixl", ["--block-size", "32"])
    assert (back.instance_cpus, back.cpu_period_ms, back.threads) == (0.5, 10, 1)
    assert (back.internal_token, back.admin_token) == ("int-tok", "adm-tok")
    assert "int-tok" not in repr(back) and "adm-tok" not in repr(back)


def test_uncapped_instances_get_the_deployments_thread_count(tmp_path: Path) -> None:
    dep = LocalDeployment(model=tmp_path, topology={T.E: 1, T.P: 1, T.D: 1})
    # a core left to the router, the rest shared out
    assert SpawnSpec.of(dep).threads == max(1, max(1, (os.cpu_count() or 1) - 1) // 3)
    assert LocalDeployment(model=tmp_path, topology={T.E: 1}).threads_per_instance() == max(1, (os.cpu_count() or 1) - 1)
    assert LocalDeployment(model=tmp_path, topology={}, threads=3).threads_per_instance() == 3


def test_a_started_process_gets_sigterm_when_its_starter_dies() -> None:
    starter = ("import subprocess, sys\n"
               "from triptych.local import _with_parent_death_signal\n"
               "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
               " preexec_fn=_with_parent_death_signal(None))\n"
               "print(child.pid, flush=True)\n")
    out = subprocess.run([sys.executable, "-c", starter], capture_output=True, text=True, timeout=60, check=True)
    pid = int(out.stdout.split()[0])

    def gone() -> bool:
        try:
            os.kill(pid, 0)
            return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"  # exited, not reaped yet
        except (ProcessLookupError, FileNotFoundError):
            return True

    if not wait_until(gone, timeout_s=10, interval_s=0.05):
        os.kill(pid, 9)
        raise AssertionError("the child outlived its starter by 10 s")
