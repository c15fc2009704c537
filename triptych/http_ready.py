"""One readiness probe over HTTP, for code that waits for a process it started (a local
deployment, a benchmark's instances, a test's server): does the URL answer 200 yet? A
refused or timed-out connection is "not yet", not an error — the process may still be
starting. The caller owns the deadline, the pause and what a timeout means."""

from __future__ import annotations

import httpx


def answers_ok(url: str, timeout_s: float = 2.0, client: httpx.Client | None = None) -> bool:
    """True when GET `url` answers 200 within timeout_s; False on any other status or when
    the connection fails (refused, reset, timed out)."""
    get = client.get if client is not None else httpx.get
    try:
        return get(url, timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False
