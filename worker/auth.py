"""Who may call a worker's endpoints: two bearer tokens, two scopes.

`/internal/*` (stage runs, aborts) takes the internal token, which only the router and
peer workers of one deployment hold; `/admin/*` (role switches, stats) takes the admin
token (the operator, the planner, a human). `/health`, `/ready`, `/live` and `/metrics`
stay open and carry no secrets (no agent metadata, handles or leases).

No token -> 401; the other scope's token -> 403; any other token -> 401. Comparison is
constant-time (hmac.compare_digest). Tokens come from the environment or a file, never
argv (it shows in `ps`). A worker without an internal token refuses to start unless it
is told `--insecure-no-auth` (then every endpoint is open: local experiments only).
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass
from pathlib import Path

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

INTERNAL_TOKEN_ENV = "TRIPTYCH_INTERNAL_TOKEN"
ADMIN_TOKEN_ENV = "TRIPTYCH_ADMIN_TOKEN"


class MissingTokenError(RuntimeError):
    """The worker has no internal token and was not told to run without auth."""


def read_token(path: str | Path | None, env: str) -> str | None:
    """A token from a file (when given) else the environment variable; None if unset."""
    if path is not None:
        return Path(path).read_text().strip() or None
    return os.environ.get(env, "").strip() or None


def bearer(token: str) -> dict[str, str]:
    """The header that carries a token (for clients of the worker)."""
    return {"authorization": f"Bearer {token}"}


def _same(given: str, expected: str | None) -> bool:
    return expected is not None and hmac.compare_digest(given.encode(), expected.encode())


@dataclass(frozen=True)
class WorkerAuth:
    internal_token: str | None
    admin_token: str | None
    insecure: bool = False

    @classmethod
    def load(cls, internal_file: str | None = None, admin_file: str | None = None,
             insecure: bool = False) -> WorkerAuth:
        auth = cls(read_token(internal_file, INTERNAL_TOKEN_ENV), read_token(admin_file, ADMIN_TOKEN_ENV),
                   insecure)
        if auth.internal_token is None and not insecure:
            raise MissingTokenError(
                f"no internal token: set {INTERNAL_TOKEN_ENV} or --internal-token-file "
                "(or pass --insecure-no-auth to serve /internal and /admin to anyone who can connect)")
        return auth

    @classmethod
    def open(cls) -> WorkerAuth:
        """No checks at all (tests of other things; `--insecure-no-auth`)."""
        return cls(None, None, insecure=True)

    def check(self, path: str, authorization: str | None) -> tuple[int, str] | None:
        """None if the call may proceed, else (status, message)."""
        if path.startswith("/internal/"):
            scope, expected, other = "internal", self.internal_token, self.admin_token
        elif path.startswith("/admin/"):
            scope, expected, other = "admin", self.admin_token, self.internal_token
        else:
            return None
        if self.insecure and expected is None:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return 401, f"{path} needs the {scope} token (Authorization: Bearer ...)"
        if _same(token, expected):
            return None
        if _same(token, other):
            return 403, f"this token does not grant the {scope} scope"
        if expected is None:
            return 403, f"{scope} endpoints are disabled: this worker has no {scope} token"
        return 401, "invalid token"



class AuthMiddleware:
    """Pure ASGI (no BaseHTTPMiddleware): a streamed stage run passes through untouched,
    its disconnects and errors included. Add with `app.add_middleware(AuthMiddleware, auth=...)`."""

    def __init__(self, app: ASGIApp, auth: WorkerAuth) -> None:
        self.app, self.auth = app, auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            raw = headers.get(b"authorization")
            refused = self.auth.check(scope["path"], raw.decode("latin-1") if raw is not None else None)
            if refused is not None:
                status, message = refused
                extra = {"www-authenticate": "Bearer"} if status == 401 else None
                response = JSONResponse({"error": {"message": message, "code": status}}, status_code=status,
                                        headers=extra)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
