"""triptych.cpu_quota against stand-in cgroup trees (v1 and v2 layouts in a temp dir), and
once against the real v1 cpu controller where this runs as root with one mounted."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from triptych import cpu_quota
from triptych.bench.idle_cpu import cpu_seconds
from triptych.cpu_quota import (
    DeploymentGroups,
    Layout,
    QuotaUnavailable,
    check_period_us,
    detect,
    quota_us,
    threads_for,
)


def v2_root(tmp_path: Path) -> Path:
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("")
    return tmp_path


def v1_root(tmp_path: Path) -> Path:
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (tmp_path / "memory").mkdir()
    return tmp_path


def test_detect_v2_v1_and_none(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert detect(v2_root(tmp_path / "a")) == Layout(2, tmp_path / "a")
    assert detect(v1_root(tmp_path / "b")) == Layout(1, tmp_path / "b" / "cpu")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "cgroup.controllers").write_text("memory pids\n")  # v2 without the cpu controller
    with pytest.raises(QuotaUnavailable, match="no cpu controller"):
        detect(tmp_path / "c")


def test_quota_and_threads_follow_the_share() -> None:
    assert quota_us(0.4) == 40_000 and quota_us(1.5) == 150_000 and quota_us(0.001) == 1_000
    assert [threads_for(x) for x in (0.2, 1.0, 1.5, 3.0)] == [1, 1, 2, 3]
    with pytest.raises(ValueError):
        quota_us(0)


def test_v2_layout_writes_cpu_max_weight_subtree_control_and_removes_all(tmp_path: Path) -> None:
    root = v2_root(tmp_path)
    groups = DeploymentGroups.create("123-abc", root)
    assert (root / "cgroup.subtree_control").read_text() == "+cpu"
    g = groups.add_instance("worker-E-0", 0.4)
    groups.add_instance("worker-D-0", 1.5)
    assert g == root / "triptych-123-abc-worker-E-0"  # flat: no parent pooling the siblings' weight
    assert (g / "cpu.max").read_text() == "40000 100000"
    assert (groups.group("worker-D-0") / "cpu.max").read_text() == "150000 100000"
    assert (g / "cpu.weight").read_text() == "40"
    assert groups.instances() == ["worker-D-0", "worker-E-0"]
    groups.move(4242, "worker-E-0")
    assert groups.pids("worker-E-0") == [4242]
    assert groups.remove() == []
    assert sorted(p.name for p in root.iterdir()) == ["cgroup.controllers", "cgroup.subtree_control"]


def test_v1_layout_writes_cfs_quota_and_shares(tmp_path: Path) -> None:
    root = v1_root(tmp_path)
    groups = DeploymentGroups.create("123-abc", root)
    g = groups.add_instance("worker-EPD-0", 0.25)
    assert g == root / "cpu" / "triptych-123-abc-worker-EPD-0"
    assert (g / "cpu.cfs_period_us").read_text() == "100000"
    assert (g / "cpu.cfs_quota_us").read_text() == "25000"
    assert (g / "cpu.shares").read_text() == "256"
    groups.move(os.getpid(), "worker-EPD-0")  # a stand-in lists it; the kernel does not: never killed
    assert groups.remove() == []
    assert sorted(p.name for p in (root / "cpu").iterdir()) == ["cpu.cfs_quota_us"]


def test_a_short_period_scales_the_quota_and_an_uncapped_group_only_weighs(tmp_path: Path) -> None:
    root = v2_root(tmp_path)
    groups = DeploymentGroups.create("123-abc", root, priority=4, period_us=10_000)
    g = groups.add_instance("worker-D-0", 0.25)
    assert (g / "cpu.max").read_text() == "2500 10000" and (g / "cpu.weight").read_text() == "100"
    r = groups.add_uncapped("router")
    assert (r / "cpu.max").read_text() == "max 10000" and (r / "cpu.weight").read_text() == "400"
    assert groups.remove() == []
    (tmp_path / "v1").mkdir()
    v1 = DeploymentGroups.create("123-abc", v1_root(tmp_path / "v1"), period_us=20_000)
    g = v1.add_instance("worker-E-0", 0.5)
    assert (g / "cpu.cfs_period_us").read_text() == "20000" and (g / "cpu.cfs_quota_us").read_text() == "10000"
    assert (v1.add_uncapped("router") / "cpu.cfs_quota_us").read_text() == "-1"
    assert v1.remove() == []
    with pytest.raises(ValueError):
        DeploymentGroups.create("x", root, period_us=500)  # under the kernel's 1 ms
    with pytest.raises(ValueError, match="at least 4 ms"):
        check_period_us(2_000, 0.25)  # a 0.5 ms quota would be raised to 1 ms: half a CPU
    assert check_period_us(10_000, 0.25) == 10_000


def test_priority_multiplies_the_weight_only(tmp_path: Path) -> None:
    root = v1_root(tmp_path)
    groups = DeploymentGroups.create("1-a", root, priority=8)
    g = groups.add_instance("w", 0.1)
    assert (g / "cpu.shares").read_text() == "819" and (g / "cpu.cfs_quota_us").read_text() == "10000"
    with pytest.raises(ValueError):
        DeploymentGroups.create("1-b", root, priority=0)
    groups.remove()


def test_remove_takes_only_its_own_deployments_groups(tmp_path: Path) -> None:
    root = v1_root(tmp_path)
    a = DeploymentGroups.create(f"{os.getpid()}-aa", root)
    b = DeploymentGroups.create(f"{os.getpid()}-bb", root)
    a.add_instance("w", 0.5)
    b.add_instance("w", 0.5)
    assert a.remove() == []
    assert [p.name for p in (root / "cpu").iterdir() if p.is_dir()] == [f"triptych-{os.getpid()}-bb-w"]
    assert b.remove() == []


def test_stale_groups_of_a_dead_owner_are_swept(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    stale = v1_root(tmp_path) / "cpu" / f"triptych-{int(dead.stdout)}-0f-worker-D-0"
    stale.mkdir()
    live = tmp_path / "cpu" / f"triptych-{os.getpid()}-0f-worker-D-0"
    live.mkdir()
    DeploymentGroups.create(None, tmp_path)
    assert not stale.exists() and live.exists()


def test_unwritable_root_raises_with_the_reason(tmp_path: Path) -> None:
    root = v1_root(tmp_path)
    groups = DeploymentGroups.create("1-a", root)
    (root / "cpu").chmod(0o555)
    try:
        if os.access(root / "cpu", os.W_OK):  # root ignores the mode bits: a file where the dir goes
            (root / "cpu").chmod(0o755)
            (root / "cpu" / "triptych-1-a-w").write_text("")
        with pytest.raises(QuotaUnavailable, match="cannot create"):
            groups.add_instance("w", 0.5)
    finally:
        (root / "cpu").chmod(0o755)


def _real_v1() -> Layout | None:
    try:
        layout = detect(Path("/sys/fs/cgroup"))
    except (QuotaUnavailable, OSError):
        return None
    return layout if layout.version == 1 and os.geteuid() == 0 and os.access(layout.base, os.W_OK) else None


@pytest.mark.skipif(_real_v1() is None, reason="needs root and a writable cgroup v1 cpu controller")
def test_real_v1_quota_caps_a_busy_child(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRIPTYCH_CGROUP_ROOT", raising=False)
    groups = DeploymentGroups.create()
    try:
        groups.add_instance("busy", 0.2)
        child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            groups.move(child.pid, "busy")
            assert groups.pids("busy") == [child.pid]
            membership = Path(f"/proc/{child.pid}/cgroup").read_text()
            assert f":cpu:/triptych-{groups.deployment_id}-busy" in membership
            time.sleep(0.3)
            t0, c0 = time.monotonic(), cpu_seconds(child.pid)
            time.sleep(3.0)
            cores = (cpu_seconds(child.pid) - c0) / (time.monotonic() - t0)
            assert cores < 0.35, f"a child capped at 0.2 CPU used {cores:.3f} cores"
        finally:
            child.kill()
            child.wait(timeout=10)
    finally:
        assert groups.remove() == []
    assert not groups.group("busy").exists()


def test_module_default_root_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TRIPTYCH_CGROUP_ROOT", str(tmp_path))
    assert cpu_quota.cgroup_root() == tmp_path
    monkeypatch.delenv("TRIPTYCH_CGROUP_ROOT")
    assert cpu_quota.cgroup_root() == Path("/sys/fs/cgroup")


@pytest.mark.parametrize(("version", "text", "want"), [
    (1, "nr_periods 10\nnr_throttled 4\nthrottled_time 2500000\nnr_bursts 0\n",
     {"nr_periods": 10, "nr_throttled": 4, "throttled_us": 2500}),
    (2, "usage_usec 9\nnr_periods 10\nnr_throttled 4\nthrottled_usec 2500\n",
     {"nr_periods": 10, "nr_throttled": 4, "throttled_us": 2500}),
])
def test_cpu_stat_reads_throttling_of_both_layouts(tmp_path: Path, version: int, text: str,
                                                   want: dict[str, int]) -> None:
    root = v2_root(tmp_path) if version == 2 else v1_root(tmp_path)
    groups = DeploymentGroups.create("1-a", root)
    groups.add_instance("w", 0.5)
    (groups.group("w") / "cpu.stat").write_text(text)
    assert groups.cpu_stat("w") == want
    (groups.group("w") / "cpu.stat").unlink()
    assert groups.cpu_stat("w") == {}
    groups.remove()
