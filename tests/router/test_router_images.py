"""Image URLs: data: URLs always; http(s) only when enabled and allow-listed (checked on
every redirect hop), with size and time limits; other schemes never. The http tests use
a real HTTP server on loopback."""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from routerkit import ScriptedBackend, chat_body, image_part, reply_events, solid_png

from triptych.router.config import RouterConfig
from triptych.router.errors import InvalidRequestError
from triptych.router.images import FetchBudget, ImageLoader, ImageRef, decode_data_url, host_allowed

PNG = solid_png(40, 30)


def ref(url: str) -> ImageRef:
    return ImageRef(url, "messages[0].content[0].image_url")


# --- data: URLs -------------------------------------------------------------------------


def test_data_url_round_trip() -> None:
    b64 = base64.b64encode(PNG).decode()
    assert decode_data_url(ref(f"data:image/png;base64,{b64}"), 1 << 20) == PNG
    # Line-wrapped base64, missing padding, no media type, octet-stream: all accepted.
    wrapped = "\n".join(b64[i:i + 60] for i in range(0, len(b64), 60))
    assert decode_data_url(ref(f"data:image/png;base64,{wrapped}"), 1 << 20) == PNG
    assert decode_data_url(ref(f"data:;base64,{b64.rstrip('=')}"), 1 << 20) == PNG
    assert decode_data_url(ref(f"data:application/octet-stream;base64,{b64}"), 1 << 20) == PNG


@pytest.mark.parametrize(("url", "code", "fragment"), [
    ("data:image/png;base64", "invalid_image_url", "malformed"),
    ("data:image/png,abc", "invalid_image_url", "base64"),
    ("data:text/html;base64,PGI+", "invalid_image_url", "not an image"),
    ("data:image/png;base64,a$b%", "invalid_base64", "base64"),
    ("data:image/png;base64,a", "invalid_base64", "base64"),
    ("data:image/png;base64,", "invalid_image", "empty"),
    ("data:image/png;base64," + "A" * 2000, "image_too_large", "limit"),
])
def test_bad_data_urls(url: str, code: str, fragment: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        decode_data_url(ref(url), 1000)
    assert info.value.code == code and fragment in info.value.message
    assert info.value.param == "messages[0].content[0].image_url"


@pytest.mark.parametrize(("url", "allow", "ok"), [
    ("http://img.example.com/a.png", ["img.example.com"], True),
    ("http://IMG.example.com./a.png", ["img.example.com"], True),
    ("http://evil.com/a.png", ["img.example.com"], False),
    ("http://img.example.com.evil.com/a.png", ["img.example.com"], False),
    ("http://img.example.com@evil.com/a.png", ["img.example.com"], False),  # userinfo trick
    ("http://a.cdn.example.com/x", ["*.example.com"], True),
    ("http://example.com/x", ["*.example.com"], False),
    ("http://badexample.com/x", ["*.example.com"], False),
    ("http://127.0.0.1:8080/x", ["127.0.0.1:8080"], True),
    ("http://127.0.0.1:9090/x", ["127.0.0.1:8080"], False),
    ("https://h.org/x", ["h.org:443"], True),
    ("http://[::1]:81/x", ["[::1]:81"], True),
    ("http://[::1]:82/x", ["[::1]:81"], False),
    ("http://h.org/x", [], False),
])
def test_host_allow_list(url: str, allow: list[str], ok: bool) -> None:
    assert host_allowed(httpx.URL(url), allow) is ok


# --- http(s) fetching against a real local server -------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    hosts_seen: list[str] = []  # the Host header of every request served

    def do_GET(self) -> None:
        _Handler.hosts_seen.append(self.headers.get("Host", ""))
        path = self.path
        if path == "/img.png":
            self._send(200, PNG)
        elif path == "/big.png":
            self._send(200, PNG + b"\0" * 5000)
        elif path == "/big-unsized.png":  # no Content-Length: the cap applies while streaming
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            for _ in range(10):
                self.wfile.write(b"\0" * 1000)
        elif path == "/slow.png":
            time.sleep(3.0)
            self._send(200, PNG)
        elif path == "/missing.png":
            self._send(404, b"nope")
        elif path.startswith("/redirect?to="):
            self.send_response(302)
            self.send_header("Location", path.split("=", 1)[1])
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif path == "/loop":
            self.send_response(302)
            self.send_header("Location", "/loop")
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            self._send(404, b"")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def loader(host: str, **overrides: object) -> ImageLoader:
    # The test server listens on loopback, which only allow_private_image_hosts lets through.
    cfg = RouterConfig(model=".", allow_http_images=True, image_host_allowlist=[host],
                       allow_private_image_hosts=True,
                       max_image_bytes=2000, image_fetch_timeout_s=10.0)  # generous: CI is loaded
    return ImageLoader(cfg.model_copy(update=overrides))


async def fetch_error(images: ImageLoader, url: str) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        await images.load(ref(url))
    return info.value


async def test_fetch_allowed(image_server: str) -> None:
    images = loader(image_server)
    try:
        assert await images.load(ref(f"http://{image_server}/img.png")) == PNG
        # Redirects are followed while they stay on allowed hosts.
        assert await images.load(ref(f"http://{image_server}/redirect?to=/img.png")) == PNG
    finally:
        await images.aclose()


async def test_fetch_refusals(image_server: str) -> None:
    images = loader(image_server)
    port = image_server.split(":")[1]
    try:
        err = await fetch_error(images, f"http://localhost:{port}/img.png")
        assert err.code == "image_host_not_allowed"
        # A redirect to a host off the list is refused (no request is made to it).
        err = await fetch_error(images, f"http://{image_server}/redirect?to=http://localhost:{port}/img.png")
        assert err.code == "image_host_not_allowed" and "localhost" in err.message
        err = await fetch_error(images, f"http://{image_server}/redirect?to=file:///etc/passwd")
        assert "scheme" in err.message
        assert (await fetch_error(images, f"http://{image_server}/loop")).message.startswith("more than")
        assert "404" in (await fetch_error(images, f"http://{image_server}/missing.png")).message
        assert (await fetch_error(images, f"http://{image_server}/big.png")).code == "image_too_large"
        assert (await fetch_error(images, f"http://{image_server}/big-unsized.png")).code == "image_too_large"
        started = time.monotonic()
        err = await fetch_error(loader(image_server, image_fetch_timeout_s=0.5), f"http://{image_server}/slow.png")
        assert "timed out" in err.message and time.monotonic() - started < 2.5
        err = await fetch_error(images, "http://127.0.0.1:1/img.png")  # off-list port
        assert err.code == "image_host_not_allowed"
    finally:
        await images.aclose()


async def test_connection_refused_is_a_400() -> None:
    sock_port = 1  # nothing listens on port 1
    images = loader(f"127.0.0.1:{sock_port}")
    try:
        err = await fetch_error(images, f"http://127.0.0.1:{sock_port}/img.png")
        assert err.code == "image_fetch_failed" and err.status_code == 400
    finally:
        await images.aclose()


async def test_schemes_and_disabled_fetching() -> None:
    images = ImageLoader(RouterConfig(model="."))
    for url in ("file:///etc/passwd", "ftp://h/x.png", "gopher://h/", "/etc/passwd", "img.png"):
        assert "scheme" in (await fetch_error(images, url)).message
    assert "disabled" in (await fetch_error(images, "https://example.com/a.png")).message


async def test_http_image_end_to_end(image_server, config, processor, make_client) -> None:
    backend = ScriptedBackend(script=lambda req: reply_events(processor))
    cfg = config.model_copy(update={"allow_http_images": True, "image_host_allowlist": [image_server],
                                    "allow_private_image_hosts": True})
    async with make_client(cfg, backend) as client:
        r = await client.post("/v1/chat/completions",
                              json=chat_body([image_part(url=f"http://{image_server}/img.png")]))
        assert r.status_code == 200, r.text
        assert backend.requests[0].images == [PNG] and len(backend.requests[0].mm_items) == 1
        r = await client.post("/v1/chat/completions", json=chat_body([image_part(url="http://example.com/a.png")]))
        assert r.status_code == 400 and r.json()["error"]["code"] == "image_host_not_allowed"


async def test_allow_listed_host_resolving_to_loopback_is_refused(image_server: str) -> None:
    port = image_server.split(":")[1]
    for host in (f"localhost:{port}", image_server):  # a name and a literal, both loopback
        images = loader(host, allow_private_image_hosts=False)
        try:
            err = await fetch_error(images, f"http://{host}/img.png")
            assert err.code == "image_host_not_allowed" and "non-public address" in err.message
        finally:
            await images.aclose()
    assert _Handler.hosts_seen.count(f"localhost:{port}") == 0  # refused before any connection


async def test_connects_to_the_checked_address_with_the_name_in_host(image_server: str) -> None:
    port = image_server.split(":")[1]
    images = loader(f"localhost:{port}")
    try:
        assert await images.load(ref(f"http://localhost:{port}/img.png")) == PNG
    finally:
        await images.aclose()
    assert _Handler.hosts_seen[-1] == f"localhost:{port}"


async def test_byte_budget_across_a_requests_urls(image_server: str) -> None:
    images = loader(image_server, max_fetch_bytes_per_request=len(PNG) + len(PNG) // 2)
    budget = FetchBudget(images.config.max_fetch_bytes_per_request)
    try:
        assert await images.load(ref(f"http://{image_server}/img.png"), budget) == PNG
        with pytest.raises(InvalidRequestError, match="bytes in all"):
            await images.load(ref(f"http://{image_server}/img.png"), budget)
    finally:
        await images.aclose()
