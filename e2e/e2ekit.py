"""Thin wrappers over kubectl and helm for the end-to-end suite. Every wait has a timeout."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "triptych"
CACHE_BIN = Path.home() / ".cache" / "triptych" / "bin"


def tool(name: str) -> str:
    """kubectl/helm from PATH, else the copies tools/fetch_helm.py puts in ~/.cache/triptych/bin."""
    found = os.environ.get(f"TRIPTYCH_{name.upper()}") or shutil.which(name)
    if found is None and (CACHE_BIN / name).exists():
        found = str(CACHE_BIN / name)
    if found is None:
        raise RuntimeError(f"{name} not found: install it or run python3 tools/fetch_helm.py --out "
                           f"{CACHE_BIN / 'helm'} --kubectl-out {CACHE_BIN / 'kubectl'}")
    return found


class Cluster:
    def __init__(self, kubeconfig: str) -> None:
        self.env = {**os.environ, "KUBECONFIG": kubeconfig}

    def run(self, name: str, *args: str, input: str | None = None, timeout: float = 300,
            check: bool = True) -> subprocess.CompletedProcess[str]:
        out = subprocess.run([tool(name), *args], input=input, capture_output=True, text=True,
                             timeout=timeout, env=self.env)
        if check and out.returncode != 0:
            raise AssertionError(f"{name} {' '.join(args)}: {out.stdout[-2000:]}\n{out.stderr[-2000:]}")
        return out

    def kubectl(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return self.run("kubectl", *args, **kw)

    def helm(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return self.run("helm", *args, **kw)

    def get(self, *args: str) -> dict[str, Any]:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def wait_for(self, what: str, check: Callable[[], Any], timeout: float, interval: float = 3) -> Any:
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                last = check()
                if last:
                    return last
            except (AssertionError, json.JSONDecodeError, KeyError) as e:
                last = e
            time.sleep(interval)
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last: {last!r}")

    @contextmanager
    def port_forward(self, namespace: str, target: str, remote_port: int) -> Iterator[str]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen([tool("kubectl"), "-n", namespace, "port-forward", target, f"{port}:{remote_port}"],
                                env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", port)) == 0:
                        break
                time.sleep(0.5)
            yield f"http://127.0.0.1:{port}"
        finally:
            proc.terminate()
            proc.wait(timeout=10)
