"""One line for a rejected input, shared by the CLI and the router (torch-free)."""

from __future__ import annotations

from pydantic import ValidationError


def short_error(exc: Exception) -> str:
    """A pydantic error as `field: message; ...`; any other error as its text."""
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in exc.errors())
    return str(exc)
