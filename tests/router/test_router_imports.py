"""The router process holds no model: importing the HTTP layer, building the app over a
real checkpoint and serving a request must not import torch (nor transformers)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_router_api_does_not_import_torch(qwen2_vl_dir) -> None:
    code = textwrap.dedent(f"""
        import sys
        import triptych.router.api
        from fastapi.testclient import TestClient
        from triptych.router.api import create_app
        from triptych.router.backend import TokenEvent
        from triptych.router.config import RouterConfig

        class Backend:
            async def generate(self, req):
                yield TokenEvent([11], finish_reason="stop")
            async def health(self):
                return {{"status": "ok", "roles": {{}}}}
            def ready(self):
                return True

        app = create_app(RouterConfig(model={str(qwen2_vl_dir)!r}, served_model_name="m"), Backend())
        with TestClient(app) as client:
            r = client.post("/v1/chat/completions", json={{"model": "m", "messages": [{{"role": "user", "content": "hi"}}]}})
            assert r.status_code == 200, r.text
        heavy = sorted(m for m in ("torch", "transformers", "torchvision") if m in sys.modules)
        print("HEAVY", heavy)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout, out.stdout
