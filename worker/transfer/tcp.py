"""The explicit fallback transport: block READs over plain TCP sockets, no NIXL.

Used only when NIXL cannot start and the engine was built with `require="any"`; the
engine then logs a warning and labels every transfer metric `transport="tcp"`. Same
semantics as the NIXL path (the target pulls byte ranges of registered regions, then
notifies the source), but CPU memory only and a copy through the kernel's socket
buffers. Each source runs one listening thread; each request is one short connection.

The source serves a READ only under a live lease granted to it (`grant`): the request
names the lease id and its secret (from the handle), and every byte range must lie in
the lease's blocks. A read without a lease, with a wrong secret, outside the leased
blocks, or after the lease was confirmed, cancelled or expired is refused.

Addresses: the server binds `host` (else TRIPTYCH_TRANSFER_HOST, else all interfaces
when POD_IP is set, else 127.0.0.1) and advertises, in its metadata, an address peers
can reach: the bind host unless it is a wildcard, else POD_IP (Kubernetes downward
API), else this host's name resolved.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import dataclasses
import hmac
import json
import logging
import os
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from triptych.worker.transfer.base import (
    MemType,
    PeerUnreachableError,
    Region,
    Segment,
    TransferError,
    TransferTimeoutError,
)

logger = logging.getLogger(__name__)

_LEN = struct.Struct("!I")
_MAX_HEADER = 16 << 20  # a request lists byte ranges; anything larger is not ours
_IO_TIMEOUT_S = 30.0  # server side: a peer that stops reading is dropped


def _memory(addr: int, nbytes: int) -> memoryview:
    """A writable byte view of registered memory (the tensor that owns it stays alive)."""
    return memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")


def _send_msg(sock: socket.socket, obj: dict[str, Any]) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_into(sock: socket.socket, view: memoryview, deadline: float | None) -> None:
    while len(view):
        if deadline is not None:
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("peer closed the connection")
        view = view[n:]


def _recv_msg(sock: socket.socket, deadline: float | None) -> dict[str, Any]:
    head = bytearray(_LEN.size)
    _recv_into(sock, memoryview(head), deadline)
    (size,) = _LEN.unpack(head)
    if size > _MAX_HEADER:
        raise ConnectionError(f"message of {size} bytes exceeds {_MAX_HEADER}")
    body = bytearray(size)
    _recv_into(sock, memoryview(body), deadline)
    return json.loads(body)


_WILDCARDS = ("", "0.0.0.0", "::")


def bind_and_advertise(host: str | None) -> tuple[str, str]:
    """(address to bind, address to put in the metadata peers dial)."""
    pod_ip = os.environ.get("POD_IP", "").strip()
    bind = host or os.environ.get("TRIPTYCH_TRANSFER_HOST") or ("0.0.0.0" if pod_ip else "127.0.0.1")
    if bind not in _WILDCARDS:
        return bind, bind
    return bind, pod_ip or socket.gethostbyname(socket.gethostname())


@dataclasses.dataclass(frozen=True)
class _Grant:
    secret: str
    ranges: tuple[tuple[int, int], ...]
    deadline: float  # monotonic

    def covers(self, addr: int, nbytes: int) -> bool:
        return nbytes > 0 and any(a <= addr and addr + nbytes <= a + n for a, n in self.ranges)


class TcpBackend:
    transport = "tcp"

    def __init__(self, agent_name: str, host: str | None = None) -> None:
        self._name = agent_name
        bind, self._host = bind_and_advertise(host)
        self._server = socket.create_server((bind, 0))
        self._server.settimeout(0.2)  # lets the accept loop notice close()
        self._port = self._server.getsockname()[1]
        self._lock = threading.Lock()
        self._ranges: list[tuple[int, int]] = []
        self._grants: dict[str, _Grant] = {}
        self._notifs: deque[bytes] = deque()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"tcp-transfer-{agent_name}", daemon=True)
        self._thread.start()

    def register(self, region: Region) -> None:
        if region.mem_type != "DRAM":
            raise TransferError(f"the tcp transport moves CPU memory only; region {region.name!r} is on {region.mem_type}")
        with self._lock:
            self._ranges.append((region.base_addr, region.nbytes))

    def deregister(self, region: Region) -> None:
        with self._lock:
            self._ranges.remove((region.base_addr, region.nbytes))

    def metadata(self) -> bytes:
        return json.dumps({"agent": self._name, "host": self._host, "port": self._port}).encode()

    def grant(self, lease_id: str, secret: str, ranges: list[tuple[int, int]], deadline: float) -> None:
        outside = [r for r in ranges if not self._registered(*r)]
        if outside:
            raise ValueError(f"lease {lease_id}: ranges outside registered memory: {outside[:4]}")
        merged: list[tuple[int, int]] = []  # adjacent blocks -> one interval (reads coalesce them)
        for addr, nbytes in sorted(ranges):
            if merged and merged[-1][0] + merged[-1][1] == addr:
                merged[-1] = (merged[-1][0], merged[-1][1] + nbytes)
            else:
                merged.append((addr, nbytes))
        with self._lock:
            self._grants[lease_id] = _Grant(secret, tuple(merged), deadline)

    def revoke(self, lease_id: str) -> None:
        with self._lock:
            self._grants.pop(lease_id, None)

    # -- target side -------------------------------------------------------------

    @contextlib.contextmanager
    def _dial(self, peer: str, peer_metadata: bytes, deadline: float) -> Iterator[socket.socket]:
        try:
            md = json.loads(peer_metadata)
            if md["agent"] != peer:
                raise ValueError(f"metadata is for agent {md['agent']!r}")
            address = (str(md["host"]), int(md["port"]))
        except (ValueError, KeyError, TypeError) as e:
            raise PeerUnreachableError(f"bad tcp metadata for {peer!r}: {e}") from e
        try:
            sock = socket.create_connection(address, timeout=max(deadline - time.monotonic(), 1e-3))
        except TimeoutError as e:
            raise TransferTimeoutError(f"tcp connect to {peer!r} at {address} timed out") from e
        except OSError as e:
            raise PeerUnreachableError(f"tcp connect to {peer!r} at {address} failed: {e}") from e
        with sock:
            try:
                yield sock
            except TimeoutError as e:
                raise TransferTimeoutError(f"tcp transfer with {peer!r} did not complete in time") from e
            except OSError as e:
                raise TransferError(f"tcp transfer with {peer!r} failed: {e}") from e

    def read(self, peer: str, peer_metadata: bytes, segs: list[Segment], remote_mem: MemType,
             remote_device: int, local_mem: MemType, local_device: int, deadline: float,
             lease: tuple[str, str] = ("", "")) -> None:
        if "VRAM" in (remote_mem, local_mem):
            raise TransferError("the tcp transport moves CPU memory only")
        with self._dial(peer, peer_metadata, deadline) as sock:
            _send_msg(sock, {"op": "read", "lease": lease[0], "secret": lease[1],
                             "ranges": [[s.remote_addr, s.nbytes] for s in segs]})
            reply = _recv_msg(sock, deadline)
            if not reply.get("ok"):
                raise TransferError(f"{peer!r} refused the READ: {reply.get('error')}")
            for s in segs:
                _recv_into(sock, _memory(s.local_addr, s.nbytes), deadline)

    def notify(self, peer: str, peer_metadata: bytes, message: bytes) -> None:
        deadline = time.monotonic() + 5.0
        with self._dial(peer, peer_metadata, deadline) as sock:
            _send_msg(sock, {"op": "notif", "from": self._name, "msg": base64.b64encode(message).decode()})
            _recv_msg(sock, deadline)

    # -- source side -------------------------------------------------------------

    def notifications(self) -> list[bytes]:
        with self._lock:
            out = list(self._notifs)
            self._notifs.clear()
        return out

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _registered(self, addr: int, nbytes: int) -> bool:
        with self._lock:
            return any(base <= addr and addr + nbytes <= base + size for base, size in self._ranges)

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(_IO_TIMEOUT_S)
                msg = _recv_msg(conn, None)
                if msg.get("op") == "notif":
                    with self._lock:
                        self._notifs.append(base64.b64decode(msg["msg"]))
                    _send_msg(conn, {"ok": True})
                elif msg.get("op") == "read":
                    ranges = [(int(a), int(n)) for a, n in msg["ranges"]]
                    refused = self._refusal(str(msg.get("lease", "")), str(msg.get("secret", "")), ranges)
                    if refused:
                        logger.warning("tcp transfer server %s: refused a read: %s", self._name, refused)
                        _send_msg(conn, {"ok": False, "error": refused})
                        return
                    _send_msg(conn, {"ok": True})
                    for addr, nbytes in ranges:
                        conn.sendall(_memory(addr, nbytes))
                else:
                    _send_msg(conn, {"ok": False, "error": f"unknown op {msg.get('op')!r}"})
            except (OSError, ValueError, KeyError, TypeError) as e:
                logger.warning("tcp transfer server %s: dropped a connection: %s", self._name, e)

    def _refusal(self, lease_id: str, secret: str, ranges: list[tuple[int, int]]) -> str | None:
        """Why a read may not be served, or None. The same answer for an unknown lease and
        a wrong secret: a caller learns nothing about leases it does not hold."""
        with self._lock:
            grant = self._grants.get(lease_id)
        if grant is None or not hmac.compare_digest(secret.encode(), grant.secret.encode()):
            return "no such lease (never granted, already confirmed or expired, or wrong secret)"
        if time.monotonic() >= grant.deadline:
            self.revoke(lease_id)
            return "the lease has expired"
        outside = [r for r in ranges if not grant.covers(*r)]
        if outside:
            return f"ranges outside the leased blocks: {outside[:4]}"
        return None

    def close(self) -> None:
        self._closed.set()
        self._server.close()
        self._thread.join(timeout=2.0)
