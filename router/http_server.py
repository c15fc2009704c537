"""Running the router's ASGI app under uvicorn with deadlines on slow clients.

uvicorn bounds an idle keep-alive connection but not a client that trickles its request
headers (slowloris): `HeaderDeadlineProtocol` closes a connection whose request head has
not fully arrived within `header_read_timeout_s` of its first byte slot (the connection's
start, or the end of the previous response). Body and write deadlines live in the front
door (front_door.py); `limit_concurrency` answers 503 past that many connections.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from triptych.listen_socket import adopt
from triptych.router.config import RouterConfig

log = logging.getLogger("triptych.router.http_server")


class HeaderDeadlineProtocol(H11Protocol):
    header_read_timeout_s: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm_header_deadline()  # the request head is in; the body has its own deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        if not self.transport.is_closing():
            self._header_deadline = self.loop.call_later(self.header_read_timeout_s, self._header_timeout)

    def _disarm_header_deadline(self) -> None:
        handle = getattr(self, "_header_deadline", None)
        if handle is not None:
            handle.cancel()
            self._header_deadline = None

    def _header_timeout(self) -> None:
        self._header_deadline = None
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            log.info("closing a connection whose request headers did not arrive within %.0fs",
                     self.header_read_timeout_s)
            self.transport.close()


def protocol_for(config: RouterConfig) -> type[H11Protocol]:
    return type("RouterH11Protocol", (HeaderDeadlineProtocol,),
                {"header_read_timeout_s": config.header_read_timeout_s})


def is_loopback(host: str) -> bool:
    """True when every address `host` names is a loopback one."""
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def check_bind(host: str, config: RouterConfig, allow_no_api_key: bool) -> None:
    """Refuse to serve a reachable address without API keys unless told so explicitly."""
    if config.load_api_keys() or allow_no_api_key or is_loopback(host):
        return
    raise SystemExit(f"refusing to serve {host} (not loopback) without API keys: give --api-key, "
                     "--api-key-file or TRIPTYCH_API_KEY, or --allow-no-api-key to serve it open")


def run(app: Any, host: str, port: int, config: RouterConfig, fd: int | None = None) -> None:
    """Serve `app` on host:port, or on the inherited bound socket `fd` (listen_socket.py)."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                           timeout_graceful_shutdown=10, http=protocol_for(config),
                                           limit_concurrency=config.limit_concurrency))
    server.run(sockets=[adopt(fd)] if fd is not None else None)
