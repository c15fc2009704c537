"""A stub router for the local planner's tests: the admin `/health` instance list, the
`POST /admin/role` contract (recorded, token checked), `POST /admin/instances` and
`DELETE /admin/instances/<id>` (recorded; a registered URL `<router>/w/<id>` becomes an
instance `<id>` of the role its id starts with), and recorded `/metrics` for the router and
each instance (`<router>/w/<id>/metrics`)."""

from __future__ import annotations

import http.server
import json
import threading
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StubRouter:
    token: str
    instances: list[dict[str, Any]]  # instance_id, role, ready, load
    waiting: dict[str, float] = field(default_factory=dict)  # instance id -> waiting requests
    refuse: bool = False
    refuse_register: bool = False
    video_gop_sets: float | None = None  # the router's triptych_frontend_video_queued_gop_sets
    calls: list[tuple[dict[str, Any], str | None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/health":
                    body: dict[str, Any] = {"status": "ok", "roles": {}, "stages": {}}
                    if self.headers.get("Authorization") == f"Bearer {stub.token}":
                        body["instances"] = [{**i, "url": f"{stub.url}/w/{i['instance_id']}"}
                                             for i in stub.instances]
                    self._send(200, json.dumps(body).encode())
                elif self.path == "/metrics":
                    self._send(200, stub.router_metrics().encode())
                elif self.path.startswith("/w/") and self.path.endswith("/metrics"):
                    self._send(200, stub.worker_metrics(self.path.split("/")[2]).encode())
                else:
                    self._send(404, b"{}")

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                auth = self.headers.get("Authorization")
                stub.calls.append((body, auth))
                if auth != f"Bearer {stub.token}":
                    self._send(401, b'{"error": {"message": "admin token required"}}')
                elif self.path == "/admin/instances":
                    if stub.refuse_register:
                        self._send(502, b'{"error": {"message": "did not answer as a Triptych worker"}}')
                        return
                    iid = body["url"].rstrip("/").rsplit("/", 1)[1]
                    stub.instances.append({"instance_id": iid, "role": iid.split("-")[0], "load": 0, "ready": True})
                    self._send(200, json.dumps({"instance_id": iid}).encode())
                elif stub.refuse:
                    self._send(409, b'{"error": {"message": "switch in progress"}}')
                else:
                    for inst in stub.instances:
                        if inst["instance_id"] == body["instance"]:
                            inst["role"] = body["role"]
                    self._send(200, json.dumps({"instance": body["instance"], "role": body["role"]}).encode())

            def do_DELETE(self) -> None:
                stub.calls.append(({"delete": self.path}, self.headers.get("Authorization")))
                iid = self.path.rsplit("/", 1)[1]
                stub.instances[:] = [i for i in stub.instances if i["instance_id"] != iid]
                self._send(200, json.dumps({"instance_id": iid}).encode())

            def _send(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def router_metrics(self) -> str:
        lines = ["# TYPE triptych_frontend_instance_ready gauge"]
        for i in self.instances:
            lines.append(f'triptych_frontend_instance_ready{{instance="{i["instance_id"]}",role="{i["role"]}"}} '
                         f'{1 if i.get("ready", True) else 0}')
        lines.append("# TYPE triptych_frontend_instance_load gauge")
        for i in self.instances:
            lines.append(f'triptych_frontend_instance_load{{instance="{i["instance_id"]}",role="{i["role"]}"}} '
                         f'{i.get("load", 0)}')
        if self.video_gop_sets is not None:
            lines += ["# TYPE triptych_frontend_video_queued_gop_sets gauge",
                      f"triptych_frontend_video_queued_gop_sets {self.video_gop_sets}"]
        return "\n".join(lines) + "\n"

    def worker_metrics(self, instance: str) -> str:
        role = next(i["role"] for i in self.instances if i["instance_id"] == instance)
        return ("# TYPE triptych_worker_requests gauge\n"
                f'triptych_worker_requests{{role="{role}",state="waiting"}} {self.waiting.get(instance, 0)}\n')

    def switched(self) -> list[tuple[str, str]]:
        return [(b["instance"], b["role"]) for b, _ in self.calls if "instance" in b]

    def registered(self) -> list[str]:
        return [b["url"] for b, _ in self.calls if "url" in b]

    def deleted(self) -> list[str]:
        return [b["delete"] for b, _ in self.calls if "delete" in b]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
