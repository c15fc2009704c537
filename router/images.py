"""Image content parts -> encoded image bytes.

`data:` URLs (base64) are always accepted. http(s) URLs are fetched only when the server
enables it, and then only from allow-listed hosts (optionally pinned to a port), with a
size cap per image and a byte budget per request, a wall-clock timeout, and redirects
followed by hand so every hop is checked again. Each hop's host is resolved once, every
address it resolves to must be a public one (not loopback, private, link-local, cloud
metadata, ...) unless the server allows private hosts, and the connection goes to that
checked address (Host header and TLS SNI keep the name): no DNS-rebinding window. Every
other scheme (file://, ftp://, ...) is refused: a URL must never read the router's own
disk or reach a host the operator did not name.

Bytes are not decoded here; the processor checks the pixel count before decoding.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urljoin

import httpx

from triptych.router.config import RouterConfig
from triptych.router.errors import InvalidRequestError

MAX_REDIRECTS = 3
_INLINE_DECODE_LIMIT = 64 * 1024  # characters of data URL decoded on the event loop itself
_ACCEPTED_DATA_TYPES = ("", "application/octet-stream")
_WHITESPACE = b" \t\r\n\x0b\x0c"


@dataclass(frozen=True)
class ImageRef:
    url: str
    param: str  # where the part sits in the request, e.g. "messages[0].content[1].image_url"
    kind: str = "image"  # "video" for video_url parts: fetched the same way, own byte cap


class FetchBudget:
    """Bytes one request may still fetch over http(s), across all its URLs."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.left = limit

    def take(self, ref: ImageRef, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise _error(ref, f"the request's image URLs hold more than {self.limit} bytes in all",
                         code="image_too_large")


def _error(ref: ImageRef, message: str, code: str = "invalid_image_url") -> InvalidRequestError:
    return InvalidRequestError(message, param=ref.param, code=code)


def decode_data_url(ref: ImageRef, max_bytes: int) -> bytes:
    """`data:image/png;base64,....` -> bytes. Only base64 payloads; the size is checked
    from the encoded length before anything is decoded."""
    header, sep, payload = ref.url.partition(",")
    if not sep:
        raise _error(ref, "malformed data URL: expected 'data:<media type>;base64,<data>'")
    params = header[len("data:"):].split(";")
    media_type = params[0].strip().lower()
    if "base64" not in (p.strip().lower() for p in params[1:]):
        raise _error(ref, "data URLs must be base64-encoded ('data:image/png;base64,...')")
    if not (media_type.startswith(f"{ref.kind}/") or media_type in _ACCEPTED_DATA_TYPES):
        article = "an" if ref.kind[0] in "aeiou" else "a"
        raise _error(ref, f"data URL media type {media_type!r} is not {article} {ref.kind} type")
    # Line-wrapped base64 is common; bytes.translate drops the whitespace in one C pass.
    raw = payload.encode("ascii", errors="replace").translate(None, _WHITESPACE)
    if len(raw) * 3 // 4 > max_bytes:
        raise _error(ref, f"{ref.kind} is larger than the {max_bytes} byte limit", code=f"{ref.kind}_too_large")
    raw += b"=" * (-len(raw) % 4)  # tolerate missing padding; real corruption still fails
    try:
        data = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise _error(ref, f"invalid base64 in {ref.kind} data URL: {exc}", code="invalid_base64") from None
    if not data:
        raise _error(ref, f"{ref.kind} data URL is empty", code=f"invalid_{ref.kind}")
    return data


def host_allowed(url: httpx.URL, allowlist: list[str]) -> bool:
    """'example.com' matches that host on any port, 'example.com:8080' that port only,
    '*.example.com' any subdomain (not the apex)."""
    host = (url.host or "").lower().rstrip(".")
    port = url.port or (443 if url.scheme == "https" else 80)
    for entry in allowlist:
        name, want_port = _split_entry(entry.strip().lower())
        if want_port and want_port != str(port):
            continue
        if name.startswith("*."):
            if host.endswith(name[1:]) and host != name[2:]:
                return True
        elif host == name:
            return True
    return False


def _split_entry(entry: str) -> tuple[str, str]:
    if entry.startswith("["):  # IPv6 literal: "[::1]" or "[::1]:8080"
        name, _, rest = entry[1:].partition("]")
        return name, rest[1:] if rest.startswith(":") else ""
    name, _, port = entry.partition(":")
    return name, port


class ImageLoader:
    """Resolves image URLs to bytes under the configured limits. One per app (it owns
    the HTTP client used for fetching, closed by `aclose`)."""

    def __init__(self, config: RouterConfig, client: httpx.AsyncClient | None = None) -> None:
        self.config = config
        self._client = client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def _cap(self, ref: ImageRef) -> int:
        return self.config.max_video_bytes if ref.kind == "video" else self.config.max_image_bytes

    async def load(self, ref: ImageRef, budget: FetchBudget | None = None) -> bytes:
        scheme = ref.url.split(":", 1)[0].lower() if ":" in ref.url else ""
        if scheme == "data":
            if len(ref.url) < _INLINE_DECODE_LIMIT:
                return decode_data_url(ref, self._cap(ref))
            # Decoding megabytes of base64 takes milliseconds: keep it off the event loop.
            return await asyncio.to_thread(decode_data_url, ref, self._cap(ref))
        if scheme in ("http", "https"):
            return await self._fetch(ref, budget or FetchBudget(self.config.max_fetch_bytes_per_request))
        shown = f"'{scheme}:'" if scheme else "none"
        raise _error(ref, f"unsupported image URL scheme {shown}: send a base64 data: URL"
                     + (" or an http(s) URL" if self.config.allow_http_images else ""))

    async def _fetch(self, ref: ImageRef, budget: FetchBudget) -> bytes:
        if not self.config.allow_http_images:
            raise _error(ref, f"fetching {ref.kind}s over http(s) is disabled on this server; "
                              f"send the {ref.kind} inline as a base64 data: URL")
        try:
            async with asyncio.timeout(self.config.image_fetch_timeout_s):
                return await self._follow(ref, budget)
        except TimeoutError:
            raise _error(ref, f"timed out after {self.config.image_fetch_timeout_s:g}s fetching "
                              f"{ref.url}", code="image_fetch_failed") from None
        except httpx.HTTPError as exc:
            raise _error(ref, f"could not fetch {ref.url}: {type(exc).__name__}",
                         code="image_fetch_failed") from None

    async def _follow(self, ref: ImageRef, budget: FetchBudget) -> bytes:
        url = ref.url
        for _ in range(MAX_REDIRECTS + 1):
            parsed = self._check_url(ref, url)
            address = await self._checked_address(ref, parsed)
            headers = {"Host": parsed.netloc.decode("ascii")}
            extensions = {"sni_hostname": parsed.host} if parsed.scheme == "https" else {}
            request = self._http().build_request("GET", parsed.copy_with(host=address), headers=headers,
                                                 extensions=extensions)
            resp = await self._http().send(request, stream=True)
            try:
                if resp.is_redirect:
                    location = resp.headers.get("location")
                    if not location:
                        raise _error(ref, f"{url} redirected without a Location", code="image_fetch_failed")
                    url = urljoin(str(parsed), location)
                    continue
                if resp.status_code != 200:
                    raise _error(ref, f"fetching {url} returned HTTP {resp.status_code}",
                                 code="image_fetch_failed")
                return await self._read_capped(ref, resp, budget)
            finally:
                await resp.aclose()
        raise _error(ref, f"more than {MAX_REDIRECTS} redirects fetching {ref.url}", code="image_fetch_failed")

    def _check_url(self, ref: ImageRef, url: str) -> httpx.URL:
        try:
            parsed = httpx.URL(url)
        except httpx.InvalidURL as exc:
            raise _error(ref, f"invalid image URL: {exc}") from None
        if parsed.scheme not in ("http", "https"):
            raise _error(ref, f"image URL scheme '{parsed.scheme}:' is not allowed")
        if not host_allowed(parsed, self.config.image_host_allowlist):
            raise _error(ref, f"image host '{parsed.host}' is not in this server's allow-list",
                         code="image_host_not_allowed")
        return parsed

    async def _checked_address(self, ref: ImageRef, url: httpx.URL) -> str:
        """Resolve once; every address must be public unless private hosts are allowed.
        Returns the address to connect to, so a second lookup cannot change the answer."""
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(url.host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise _error(ref, f"cannot resolve image host '{url.host}': {exc}", code="image_fetch_failed") from None
        addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
        if not addresses:
            raise _error(ref, f"image host '{url.host}' has no address", code="image_fetch_failed")
        if not self.config.allow_private_image_hosts:
            for addr in addresses:
                if not addr.is_global:  # loopback, private, link-local (cloud metadata), reserved, ...
                    raise _error(ref, f"image host '{url.host}' resolves to a non-public address ({addr}); "
                                      "this server fetches only from public addresses",
                                 code="image_host_not_allowed")
        first = addresses[0]
        return f"[{first}]" if first.version == 6 else str(first)

    async def _read_capped(self, ref: ImageRef, resp: httpx.Response, budget: FetchBudget) -> bytes:
        cap = self._cap(ref)
        too_big = _error(ref, f"{ref.kind} at {ref.url} is larger than the {cap} byte limit",
                         code=f"{ref.kind}_too_large")
        declared = resp.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > cap:
            raise too_big
        buf = bytearray()
        async for chunk in resp.aiter_bytes():
            buf += chunk
            budget.take(ref, len(chunk))
            if len(buf) > cap:
                raise too_big
        if not buf:
            raise _error(ref, f"{ref.url} returned an empty body", code=f"invalid_{ref.kind}")
        return bytes(buf)

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            # trust_env=False: proxy variables must not reroute fetches around the allow-list.
            self._client = httpx.AsyncClient(follow_redirects=False, trust_env=False,
                                             timeout=self.config.image_fetch_timeout_s)
        return self._client
