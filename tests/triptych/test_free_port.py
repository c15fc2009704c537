"""`triptych.local.free_port` never hands out a port twice in one process, even when the
kernel offers it again (it did in CI: two instances of one deployment got the same port)."""

from __future__ import annotations

import socket

import pytest

from triptych import local


class _Probe:
    """A socket whose bind(0) lands on the next port of a scripted sequence."""

    ports: list[int] = []

    def __init__(self, *args: object) -> None:
        self.port = 0

    def __enter__(self) -> _Probe:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def bind(self, address: tuple[str, int]) -> None:
        self.port = _Probe.ports.pop(0)

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)


def test_a_port_offered_again_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "_HANDED_OUT", set())
    monkeypatch.setattr(socket, "socket", _Probe)
    _Probe.ports = [40001, 40001, 40001, 40002]
    assert local.free_port() == 40001
    assert local.free_port() == 40002  # the kernel offered 40001 twice more
    assert _Probe.ports == []


def test_real_ports_are_distinct_and_bindable() -> None:
    ports = [local.free_port() for _ in range(20)]
    assert len(set(ports)) == 20
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[-1]))
