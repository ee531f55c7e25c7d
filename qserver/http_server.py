"""The HTTP port (`<http host port>`): Prometheus metrics and the probes.

    GET /metrics   the node's metrics (metrics.py), Prometheus' text format
                   (OpenMetrics if the scraper's Accept header asks for it)
    GET /healthz   200 "ok": the event loop answers
    GET /readyz    200 if the node is ready, else 503; either way a JSON
                   body, the same as action 109 (Service.health): ready,
                   reasons, role, leader_node_id, applied_id, commit_id

Theory of operation
-------------------
A deliberately small HTTP/1.1 server on the node's event loop: no thread
(prometheus_client's start_http_server runs one, which would read the
store while the loop changes it), no framework. A connection carries one
request: its head is read (at most MAX_HEAD_BYTES, all of it within
TIMEOUT_S of the connection's start), answered with `Connection: close`,
and our side is shut once the answer is written (the client closes when it
has read it; a client that does not is dropped at TIMEOUT_S). Scrapers and
probes open a connection per request anyway, and a server that never
reuses a connection has no keep-alive, pipelining or body framing to get
wrong.

Rules
- GET and HEAD only (405 otherwise, with `Allow`); a request line or
  header that does not parse, an HTTP version other than 1.0 and 1.1, or a
  head over MAX_HEAD_BYTES is answered 400; an unknown path 404. A body
  the client sends is never read (the connection closes after the answer).
- At most MAX_CONNECTIONS connections at once; more are closed at once
  (a probe retries; the client port is unaffected).
- An answer that cannot be computed (an exception in the collector or in
  health) is answered 500 and logged with its traceback; it does not stop
  the node (the fail-stop handler sees nothing): this port reads the
  node's state and changes nothing, and the clients' port matters more.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import orjson

__all__ = ["HttpServer", "MAX_HEAD_BYTES", "MAX_CONNECTIONS", "TIMEOUT_S"]

log = logging.getLogger(__name__)

# A request head larger than this is refused (400): a probe's or a
# scraper's is a few hundred bytes; this leaves room for long headers
# that proxies add, and bounds what a connection can make us hold.
MAX_HEAD_BYTES = 16 * 1024
# Connections open at once: a few scrapers and probes need a handful;
# the bound keeps a flood of idle connections from holding descriptors.
MAX_CONNECTIONS = 64
# A connection is aborted this long after it opened, answered or not: a
# client that sends half a request, or never reads a large answer, holds
# nothing longer (a scrape of the largest state takes well under this).
TIMEOUT_S = 10.0

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            500: "Internal Server Error", 503: "Service Unavailable"}
_TEXT = "text/plain; charset=utf-8"
_JSON = "application/json"
_TOKEN = frozenset(b"!#$%&'*+-.^_`|~0123456789"
                   b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")  # RFC 9110 tchar


def response(status: int, body: bytes, content_type: str = _TEXT, *, head_only: bool = False,
             extra: tuple[tuple[str, str], ...] = ()) -> bytes:
    """An HTTP/1.1 answer that closes the connection."""
    lines = [f"HTTP/1.1 {status} {_REASONS[status]}", f"Content-Type: {content_type}",
             f"Content-Length: {len(body)}", "Connection: close", "Cache-Control: no-store"]
    lines += [f"{name}: {value}" for name, value in extra]
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head if head_only else head + body


class Request:
    """A parsed request head: the method, the path (no query) and the
    headers (names lower-cased; a repeated one keeps its last value)."""

    __slots__ = ("method", "path", "headers")

    def __init__(self, method: str, path: str, headers: dict[str, str]) -> None:
        self.method = method
        self.path = path
        self.headers = headers


def parse_head(head: bytes) -> Request | str:
    """The request head (without its blank line) -> a Request, or the
    reason it is refused (a 400)."""
    lines = head.replace(b"\r\n", b"\n").split(b"\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3:
        return "malformed request line"
    method, target, version = parts
    if not method or not set(method) <= _TOKEN:
        return "malformed method"
    if version not in (b"HTTP/1.1", b"HTTP/1.0"):
        return "unsupported HTTP version"
    if not target.startswith(b"/") or any(c <= 0x20 or c >= 0x7f for c in target):
        return "malformed target"
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name or not set(name) <= _TOKEN:
            return "malformed header"
        headers[name.decode("ascii").lower()] = value.strip(b" \t").decode("latin-1")
    path = target.split(b"?", 1)[0].decode("ascii")
    return Request(method.decode("ascii"), path, headers)


class HttpServer:
    """The node's HTTP port. `metrics(accept)` -> (body, content type) of
    /metrics; `health()` -> the dict of /readyz (its "ready" decides the
    status)."""

    def __init__(self, *, metrics: Callable[[str], tuple[bytes, str]],
                 health: Callable[[], dict[str, Any]]) -> None:
        self.metrics = metrics
        self.health = health
        self.connections: set[_HttpProtocol] = set()
        self._server: asyncio.base_events.Server | None = None

    async def start(self, host: str, port: int) -> None:
        """Bind `host:port` (0: any free port). Raises OSError."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _HttpProtocol(self), host, port,
                                                reuse_address=True)

    @property
    def address(self) -> tuple[str, int]:
        """The bound address (the real port when configured as 0)."""
        assert self._server is not None and self._server.sockets
        host, port = self._server.sockets[0].getsockname()[:2]
        return host, port

    def close(self) -> None:
        """Stop accepting and drop every connection (a probe sees the node
        go, which is what it is for)."""
        if self._server is not None:
            self._server.close()
        for protocol in list(self.connections):
            protocol.abort()

    async def wait_closed(self) -> None:
        if self._server is not None:
            await self._server.wait_closed()

    def answer(self, request: Request) -> bytes:
        """The whole answer to a request that parsed."""
        head_only = request.method == "HEAD"
        if request.method not in ("GET", "HEAD"):
            return response(405, b"method not allowed\n", extra=(("Allow", "GET, HEAD"),))
        path = request.path
        try:
            if path == "/metrics":
                body, content_type = self.metrics(request.headers.get("accept", ""))
                return response(200, body, content_type, head_only=head_only)
            if path == "/healthz":
                return response(200, b"ok\n", head_only=head_only)
            if path == "/readyz":
                health = self.health()
                status = 200 if health.get("ready") else 503
                return response(status, orjson.dumps(health) + b"\n", _JSON, head_only=head_only)
        except Exception:
            log.exception("http: GET %s failed", path)
            return response(500, b"internal error\n", head_only=head_only)
        return response(404, b"not found\n", head_only=head_only)


class _HttpProtocol(asyncio.Protocol):
    """One HTTP connection: one request, one answer, then closed."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.answered = False
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if len(self.server.connections) >= MAX_CONNECTIONS:
            self.answered = True
            transport.close()
            return
        self.server.connections.add(self)
        self.timer = asyncio.get_running_loop().call_later(TIMEOUT_S, self.abort)

    def data_received(self, data: bytes) -> None:
        if self.answered:
            return  # a body, or a second request: never read
        buffer = self.buffer
        start = max(0, len(buffer) - 3)  # the blank line may straddle reads
        buffer += data
        # The head ends at a blank line: CRLF CRLF, or LF LF from a client
        # that ends lines with LF alone (RFC 9112 lets a server accept it).
        end, size = buffer.find(b"\r\n\r\n", start), 4
        bare = buffer.find(b"\n\n", start)
        if bare >= 0 and (end < 0 or bare < end):
            end, size = bare, 2
        if end < 0:
            if len(buffer) > MAX_HEAD_BYTES:
                self._send(response(400, b"request head too large\n"))
            return
        if end > MAX_HEAD_BYTES:
            self._send(response(400, b"request head too large\n"))
            return
        request = parse_head(bytes(buffer[:end]))
        del buffer[:end + size]
        if isinstance(request, str):
            self._send(response(400, request.encode() + b"\n"))
        else:
            self._send(self.server.answer(request))

    def eof_received(self) -> bool:
        if not self.answered:  # the client went before its head was whole
            self.abort()
        return False  # answered: the transport closes once the answer is written

    def _send(self, data: bytes) -> None:
        """Answer, then half-close: the client reads to our EOF and closes,
        and what it sent meanwhile is read and dropped. (Closing at once
        with its bytes unread would make the kernel reset the connection,
        which can destroy the answer before the client has read it.)"""
        self.answered = True
        self.buffer.clear()
        transport = self.transport
        if transport is not None:
            transport.write(data)
            if transport.can_write_eof():
                transport.write_eof()
            else:
                transport.close()  # once what is written has gone

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.server.connections.discard(self)
        if self.timer is not None:
            self.timer.cancel()
