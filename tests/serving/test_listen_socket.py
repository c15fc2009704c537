"""A local deployment binds each process's port itself and hands the bound socket down
(`--fd`, triptych/listen_socket.py): the port is held from the moment it is chosen, so
nothing else on the machine can take it while the process loads its model, and the
process serves on exactly that socket."""

from __future__ import annotations

import errno
import os
import socket

import httpx
import pytest

from triptych.listen_socket import adopt, reserve
from triptych.local import LocalDeployment
from triptych.tiny_model import tiny_model_path
from triptych.topology import InstanceType

pytestmark = pytest.mark.timeout(300)


def test_a_reserved_socket_holds_its_port_and_is_adopted_as_it_is() -> None:
    sock = reserve("127.0.0.1")
    try:
        port = sock.getsockname()[1]
        with socket.socket() as other, pytest.raises(OSError) as taken:
            other.bind(("127.0.0.1", port))
        assert taken.value.errno == errno.EADDRINUSE
        child = adopt(os.dup(sock.fileno()))  # what the child does with its inherited descriptor
        with child:
            assert child.family == socket.AF_INET and child.getsockname() == ("127.0.0.1", port)
    finally:
        sock.close()


def test_a_worker_holds_its_port_before_it_is_ready_and_serves_on_it(tmp_path) -> None:
    dep = LocalDeployment(model=tiny_model_path("qwen2-vl"), topology={InstanceType.E: 1}, log_dir=tmp_path)
    worker = dep.start_worker(InstanceType.E, 0)
    dep.processes.append(worker)
    try:
        port = int(worker.url.rsplit(":", 1)[1])
        with socket.socket() as other, pytest.raises(OSError):  # held while the model loads
            other.bind(("127.0.0.1", port))
        assert "--fd" in worker.popen.args
        dep.wait_ready([worker])
        assert httpx.get(f"{worker.url}/health", timeout=10).json()["role"] == "E"
    finally:
        dep.stop()
