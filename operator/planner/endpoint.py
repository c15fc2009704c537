"""The planner's HTTP endpoint: `/metrics` (the triptych_planner_* series), `/plan` (the
driver's PlanDocument as JSON; in the operator, one per deployment) and `/health`. Stdlib server in a thread: the planner
loop is synchronous and the endpoint only reads what the loop last published."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel


class PlannerEndpoint:
    def __init__(self, host: str, port: int, registry: CollectorRegistry,
                 document: Callable[[], BaseModel]) -> None:
        self.registry = registry
        self.document = document
        endpoint = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, CONTENT_TYPE_LATEST, generate_latest(endpoint.registry))
                elif path == "/plan":
                    self._send(200, "application/json", endpoint.document().model_dump_json(indent=2).encode())
                elif path == "/health":
                    self._send(200, "application/json", b'{"status": "ok"}')
                else:
                    self._send(404, "application/json", b'{"error": {"message": "not found", "code": 404}}')

            def _send(self, code: int, content_type: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass  # one line per Prometheus scrape is noise

        self.server = http.server.ThreadingHTTPServer((host, port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, name="planner-endpoint", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> PlannerEndpoint:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
