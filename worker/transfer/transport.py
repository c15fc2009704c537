"""Which transport an instance moves blocks with: NIXL, else the explicit TCP fallback.

A fallback is never silent (DESIGN.md, transfer engine): NIXL with the UCX plugin is
the default; if it cannot start, `require="nixl"` refuses with the underlying error
(`TransportUnavailableError`), and `require="any"` falls back to `tcp.TcpBackend` with a
startup warning. The engine then labels every transfer metric `transport="tcp"` and
reports the transport on `/health` and `/admin/stats`.
"""

from __future__ import annotations

import logging
from typing import Literal

from triptych.worker.transfer.base import Backend, TransportUnavailableError
from triptych.worker.transfer.nixl import NixlBackend

logger = logging.getLogger(__name__)

Require = Literal["nixl", "any"]


def open_backend(agent_name: str, require: Require, nixl_plugin: str = "UCX",
                 tcp_host: str | None = None) -> Backend:
    """NIXL, else (require="any" only) the explicit TCP fallback, announced with a warning."""
    if require not in ("nixl", "any"):
        raise ValueError(f"require must be 'nixl' or 'any', got {require!r}")
    try:
        return NixlBackend(agent_name, nixl_plugin)
    except TransportUnavailableError as e:
        if require == "nixl":
            raise
        from triptych.worker.transfer.tcp import TcpBackend

        logger.warning("NIXL unavailable (%s); falling back to the TCP transport (slower, CPU memory only)", e)
        return TcpBackend(agent_name, host=tcp_host)
