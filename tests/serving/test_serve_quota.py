"""`triptych serve --instance-cpus X`: every instance in its own cgroup with X CPUs of quota
and ceil(X) threads, the groups gone after SIGTERM or after a child dies; and, where no
quota can be set, a plain message on stderr and a deployment that serves anyway."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import servekit

from triptych.cpu_quota import Layout, QuotaUnavailable, detect
from triptych.local import free_port

pytestmark = pytest.mark.slow


def _real_layout() -> Layout | None:
    try:
        layout = detect(Path("/sys/fs/cgroup"))
    except (QuotaUnavailable, OSError):
        return None
    return layout if os.geteuid() == 0 and os.access(layout.base, os.W_OK) else None


needs_cgroups = pytest.mark.skipif(_real_layout() is None, reason="needs root and a writable cpu controller")


@contextmanager
def _serve(topology: str, cpus: float, env: dict[str, str], stderr: Path,
           *more: str) -> Iterator[tuple[subprocess.Popen[str], int]]:
    port = free_port()
    with servekit.serve_cli(port, topology, "--instance-cpus", str(cpus), *more, env=env, stderr=stderr) as proc:
        line = servekit.wait_for_line(proc, "serving", stderr=stderr)
        assert f"http://127.0.0.1:{port}/v1" in line
        yield proc, port


def _one_completion(port: int) -> None:
    name = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"][0]["id"]
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120,
                   json={"model": name, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def _groups_of(layout: Layout, serve_pid: int) -> list[Path]:
    """The instance groups `serve` (pid) made: the deployment id starts with its pid."""
    return sorted(p for p in layout.base.iterdir() if p.name.startswith(f"triptych-{serve_pid}-"))


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")


def _thread_env(pid: int) -> str:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next(e.decode() for e in env if e.startswith(b"OMP_NUM_THREADS="))


def _check_groups(layout: Layout, proc: subprocess.Popen[str], instances: int, quota_us: int) -> list[Path]:
    groups = _groups_of(layout, proc.pid)
    assert len(groups) == instances and all("-worker-" in g.name for g in groups)
    quota_file = "cpu.max" if layout.version == 2 else "cpu.cfs_quota_us"
    inside: list[int] = []
    for g in groups:
        assert (g / quota_file).read_text().split()[0] == str(quota_us)
        inside += [int(p) for p in (g / "cgroup.procs").read_text().split()]
    children = servekit.children(proc.pid)
    workers = [pid for pid in children if pid in inside]
    assert len(workers) == instances == len(children) - 1  # every instance inside; the router is not
    assert all(_thread_env(pid) == "OMP_NUM_THREADS=1" for pid in workers)
    return groups


@needs_cgroups
def test_serve_puts_each_instance_in_its_group_and_removes_them_on_sigterm(tmp_path: Path) -> None:
    layout = _real_layout()
    assert layout is not None
    with _serve("1E1P1D", 0.5, dict(os.environ), tmp_path / "stderr") as (proc, port):
        groups = _check_groups(layout, proc, 3, 50_000)
        _one_completion(port)
        servekit.stop_cleanly(proc, servekit.children(proc.pid))
        assert not any(g.exists() for g in groups)


@needs_cgroups
def test_groups_are_removed_when_an_instance_dies(tmp_path: Path) -> None:
    layout = _real_layout()
    assert layout is not None
    with _serve("EPD", 0.75, dict(os.environ), tmp_path / "stderr") as (proc, _):
        (group,) = _check_groups(layout, proc, 1, 75_000)
        (worker,) = [int(p) for p in (group / "cgroup.procs").read_text().split()]
        os.kill(worker, signal.SIGKILL)
        assert proc.wait(timeout=60) == 1
        assert "exited with code -9; shutting down" in (tmp_path / "stderr").read_text()
        assert not group.exists()


def test_no_quota_possible_says_so_and_serves(tmp_path: Path) -> None:
    """A cgroup root without a cpu controller stands in for a machine where quotas cannot be set.
    `--threads` overrides the thread count the share would give (ceil(0.5) = 1)."""
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("memory pids\n")
    with _serve("EPD", 0.5, {**os.environ, "TRIPTYCH_CGROUP_ROOT": str(root)}, tmp_path / "stderr",
                "--threads", "2") as (proc, port):
        (worker,) = [pid for pid in servekit.children(proc.pid) if b" worker " in _cmdline(pid)]
        assert _thread_env(worker) == "OMP_NUM_THREADS=2"
        _one_completion(port)
        servekit.stop_cleanly(proc)
        err = (tmp_path / "stderr").read_text()
        assert "--instance-cpus 0.5: cannot set a CPU quota (no cpu controller under" in err
        assert "running WITHOUT quotas (instances share every core; threads still 2 each)" in err
        assert sorted(p.name for p in root.iterdir()) == ["cgroup.controllers"]
