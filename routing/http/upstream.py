"""The gateway's HTTP/1.1 client to the nodes: httptools on asyncio protocols, a keep-alive pool per node.

Chosen by profile (docs/gateway.md, "Where the CPU goes"): aiohttp spent ~60 us of Python per
proxied request (request and response objects, header multidicts, URL handling, a timeout
reschedule per chunk, its payload registry); this client does what the gateway needs in a
fraction of that: the request head is prebuilt per (node, path) (``Target``), the client's
forwarded headers and the body go out in one write, the response head is parsed by httptools
into a list of raw header pairs, and body chunks are handed over as they arrive.

Errors (the proxy's retry and breaker rules key on these):
- ``ConnectFailed`` (``ConnectTimeout``): no TCP (or TLS) connection to the node;
- ``Disconnected``: the node closed the connection before or during the response;
- ``ReadTimeout``: no byte for ``read_timeout_s`` while a response was expected;
- ``ProtocolError``: bytes that are not an HTTP/1.1 response (a status below 100, a head past
  ``_MAX_HEAD_BYTES``, or more framing than body after the head: ``_framing_ok``).

Pool: idle connections per origin (scheme, host, port), newest first, closed after
``keepalive_s`` idle; one is reused only if its response ended cleanly with keep-alive. Flow
control: a response that buffers more than ``_HIGH_WATER`` bytes the proxy has not taken yet
pauses reading from the node (a slow client slows the node's stream instead of growing memory).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit

import httptools

_HIGH_WATER: Final = 1 << 20
# The longest response head (status line, header fields, interim answers) a node may send. vLLM's
# are ~200 bytes; httptools holds an unfinished field whole and grows it by a copy per read, so an
# endless one cost memory and quadratic copying on the event loop until the read timeout.
_MAX_HEAD_BYTES: Final = 64 * 1024
# A response's Content-Type as the relay compares it ("text/event-stream"), per value the nodes
# send (the same few on every answer): four bytes methods and a decode each time cost ~1.5 k
# instructions a response. Bounded: a value past the cap is worked out each time.
_MEDIA_TYPES: Final[dict[bytes, str]] = {}
_MEDIA_TYPES_MAX: Final = 256
_monotonic: Final = time.monotonic  # a C static, compiled: no module lookup per call


def _media_type(content_type: bytes) -> str:
    media_type = content_type.split(b";", 1)[0].strip().lower().decode("latin-1")
    if len(_MEDIA_TYPES) < _MEDIA_TYPES_MAX:
        _MEDIA_TYPES[content_type] = media_type
    return media_type


class UpstreamError(Exception):
    """Any failure talking to a node."""


class ConnectFailed(UpstreamError):
    """No connection to the node (refused, unreachable, name not resolved, TLS failed)."""


class ConnectTimeout(ConnectFailed):
    """The connection was not established within the connect timeout."""


class Disconnected(UpstreamError):
    """The node closed the connection before the response was complete."""


class ReadTimeout(UpstreamError):
    """No byte from the node within the read timeout."""


class ProtocolError(UpstreamError):
    """The node sent something that is not a valid HTTP/1.1 response."""


@dataclass(frozen=True, slots=True)
class Target:
    """One (node, path): where to connect and the prebuilt start of every request head."""

    origin: tuple[str, str, int]  # (scheme, host, port): the pool key
    host: str
    port: int
    tls: bool
    head: bytes  # b"POST /path HTTP/1.1\r\nHost: host:port\r\n"
    url: str


def make_target(url: str, method: str = "POST") -> Target:
    """Parse a node URL once (at table build), e.g. ``http://10.0.0.5:8000/v1/chat/completions``."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host_header = parts.netloc.rsplit("@", 1)[-1]
    head = f"{method} {path} HTTP/1.1\r\nHost: {host_header}\r\n".encode("latin-1")
    return Target((parts.scheme, parts.hostname, port), parts.hostname, port, tls, head, url)


def encode_headers(headers: list[tuple[bytes, bytes]]) -> bytes:
    """Header lines for a request head (the values come from httptools: no CR or LF in them).

    Four pieces a header joined once: ``name + b": " + value + b"\r\n"`` made three bytes objects
    a header (~0.4 k instructions each header, every request)."""
    parts: list[bytes] = []
    for name, value in headers:
        parts.append(name)
        parts.append(b": ")
        parts.append(value)
        parts.append(b"\r\n")
    return b"".join(parts)


class UpstreamResponse:
    """A node's response: status and raw headers at once, the body as it arrives."""

    __slots__ = (
        "_chunks",
        "_conn",
        "_done",
        "_error",
        "_paused",
        "_size",
        "_waiter",
        "_whole",
        "content_encoded",
        "content_type",
        "raw_headers",
        "status",
    )

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self.status = 0
        # (name, value) as the node sent them, names lower-cased (once, here: whoever reads them
        # compares names without lowering each again).
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.content_type = ""
        self.content_encoded = False
        self._chunks: list[bytes] = []  # a list: built without a call (a deque is a generic one)
        self._size = 0
        self._done = False
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._whole = False  # read() wants it all: no flow control

    # -- fed by the connection --

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._size > _HIGH_WATER and not self._paused and not self._whole:
            self._paused = True
            self._conn.pause()
        self._wake()

    def _finish(self, error: UpstreamError | None = None) -> None:
        if not self._done:
            self._done = True
            self._error = error
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    # -- read by the proxy --

    async def readany(self) -> bytes:
        """The body bytes that arrived since the last call (waiting for some); b"" at the end."""
        while not self._chunks:
            if self._done:
                if self._error is not None:
                    raise self._error
                return b""
            await self._wait()
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._size = 0
        if self._paused:
            self._paused = False
            self._conn.resume()
        return data

    @property
    def body_started(self) -> bool:
        """Body bytes have arrived (not yet read), or the body has ended."""
        return bool(self._chunks) or self._done

    async def first_body(self) -> None:
        """Wait for the body's first bytes (left for ``readany``) or its end; raises the error that
        ended it before any byte came."""
        while not self._chunks:
            if self._done:
                if self._error is not None:
                    raise self._error
                return
            await self._wait()

    async def read(self) -> bytes:
        """The whole body."""
        self._whole = True
        if self._paused:
            self._paused = False
            self._conn.resume()
        while not self._done:
            await self._wait()
        if self._error is not None:
            raise self._error
        data = b"".join(self._chunks)
        self._chunks.clear()
        return data

    async def _wait(self) -> None:
        conn = self._conn
        waiter = self._waiter = conn.loop.create_future()
        conn.arm_read(waiter)
        try:
            await waiter
        finally:
            conn.read_waiter = None

    def close(self) -> None:
        """Done with it: a response not read to its end drops the connection (the node sees it)."""
        if not self._done:
            self._finish(Disconnected("response closed before its end"))
            self._conn.abort()


class _Connection(asyncio.Protocol):
    """One keep-alive connection to a node; parses the responses of its requests."""

    def __init__(self, pool: UpstreamClient, origin: tuple[str, str, int]) -> None:
        self.pool = pool
        self.origin = origin
        self.loop = pool.loop
        self.read_timeout_s = pool.read_timeout_s
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self.head_waiter: asyncio.Future[UpstreamResponse] | None = None
        self.reusable = False
        self.closed = False
        self.idle_since = 0.0
        self.head_bytes = 0  # bytes read while the current response's head is incomplete
        # After the head: bytes read minus the body bytes they carried (chunk sizes, CRLFs, a
        # chunked answer's trailer fields), and the body so far; see ``_framing_ok``.
        self.framing_bytes = 0
        self.body_bytes = 0
        self.counting = False  # the bytes being parsed came after the head
        self._content_type = b""
        # The read timeout: one lazy timer per connection. Arming moves a deadline (always
        # later: the timeout is fixed); the timer re-arms itself for the rest when it fires early.
        self.read_waiter: asyncio.Future[Any] | None = None
        self.read_deadline = 0.0
        self.read_timer: asyncio.TimerHandle | None = None

    # -- asyncio --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:  # bytes nobody asked for: the connection cannot be trusted
            self.abort()
            return
        counting = self.counting = response.status != 0
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ProtocolError(f"invalid response from the node: {exc}"))
            self.abort()
            return
        if counting:
            self.framing_bytes += len(data)
            if not self._framing_ok():
                self._fail(ProtocolError("the node's answer is more framing than body (an endless trailer?)"))
                self.abort()
        elif response.status == 0:  # the head is still incomplete: all of these bytes were head
            self.head_bytes += len(data)
            if self.head_bytes > _MAX_HEAD_BYTES:
                self._fail(ProtocolError(f"the node's response head is past {_MAX_HEAD_BYTES} bytes"))
                self.abort()

    def eof_received(self) -> bool | None:
        response = self.response
        if response is not None and response.status and not self._framed():
            self._complete()  # a body delimited by the end of the connection
        return None  # close

    def connection_lost(self, exc: Exception | None) -> None:
        if self.read_timer is not None:
            self.read_timer.cancel()
            self.read_timer = None
        self.closed = True
        self.reusable = False
        self.pool.forget(self)
        self._fail(Disconnected("the node closed the connection"))

    # -- httptools --

    def on_header(self, name: bytes, value: bytes) -> None:
        response = self.response
        assert response is not None
        if response.status:
            return  # a trailer field of a chunked answer: after the head, never forwarded
        lower = name.lower()
        response.raw_headers.append((lower, value))
        if lower == b"content-type":
            self._content_type = value
        elif lower == b"content-encoding":
            response.content_encoded = True

    def on_headers_complete(self) -> None:
        response = self.response
        assert response is not None
        status = self.parser.get_status_code()
        if status < 200:
            if status < 100:  # httptools takes any three digits; 0 would read as "no head yet"
                raise ProtocolError(f"status {status}")  # httptools raises it as a parser error
            response.raw_headers = []  # an interim answer (100 Continue): wait for the real one
            return
        response.status = status
        content_type = self._content_type
        media_type = _MEDIA_TYPES.get(content_type)
        response.content_type = media_type if media_type is not None else _media_type(content_type)
        waiter = self.head_waiter
        self.head_waiter = None
        if waiter is not None:
            try:  # not done() first: as costly as set_result (compiled, generic method calls)
                waiter.set_result(response)
            except asyncio.InvalidStateError:
                pass  # cancelled (the request was): nobody waits

    def on_body(self, body: bytes) -> None:
        size = len(body)
        self.body_bytes += size
        if self.counting:
            self.framing_bytes -= size
        if self.response is not None:
            self.response._feed(body)

    def on_message_complete(self) -> None:
        if self.response is not None and self.response.status == 0:
            return  # the end of an interim response
        self._complete()

    # -- internals --

    def arm_read(self, waiter: asyncio.Future[Any]) -> None:
        """Fail ``waiter`` with ``ReadTimeout`` unless it is done within the read timeout."""
        self.read_waiter = waiter
        self.read_deadline = self.loop.time() + self.read_timeout_s
        if self.read_timer is None:
            self.read_timer = self.loop.call_at(self.read_deadline, self._read_expired)

    def _read_expired(self) -> None:
        self.read_timer = None
        waiter = self.read_waiter
        if waiter is None or waiter.done() or self.closed:
            return
        if self.read_deadline > self.loop.time():
            self.read_timer = self.loop.call_at(self.read_deadline, self._read_expired)
            return
        self.read_waiter = None
        waiter.set_exception(ReadTimeout("no byte from the node within the read timeout"))

    def _framing_ok(self) -> bool:
        """Whether what came after the head is mostly body. A chunked answer frames each chunk in
        a few bytes (vLLM sends an SSE event of ~100-300 bytes a chunk); its trailer fields come
        after the last chunk, unbounded by HTTP. A node that sent endless trailer fields (or one
        endless field, which httptools holds whole and grows by a copy per read) was read until
        the read timeout, all of it kept. Allowed: the head limit, plus half the body so far."""
        return self.framing_bytes <= _MAX_HEAD_BYTES + (self.body_bytes >> 1)

    def _framed(self) -> bool:
        response = self.response
        assert response is not None
        for lower, value in response.raw_headers:  # names lower-cased by on_header
            if lower == b"content-length" or (lower == b"transfer-encoding" and b"chunked" in value.lower()):
                return True
        return response.status in (204, 304)

    def _complete(self) -> None:
        response = self.response
        if response is None:
            return
        self.response = None
        self.reusable = self.parser.should_keep_alive() and not self.closed
        response._finish()
        if self.reusable:
            self.pool.release(self)
        else:
            self.abort()

    def _fail(self, error: UpstreamError) -> None:
        waiter = self.head_waiter
        self.head_waiter = None
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)
        response = self.response
        if response is not None:
            self.response = None
            response._finish(error)

    def pause(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def abort(self) -> None:
        self.reusable = False
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.abort()

    def send(self, data: bytes) -> asyncio.Future[UpstreamResponse]:
        assert self.transport is not None
        self.response = UpstreamResponse(self)
        self._content_type = b""
        self.head_bytes = self.framing_bytes = self.body_bytes = 0
        waiter = self.head_waiter = self.loop.create_future()
        self.transport.write(data)
        return waiter


class UpstreamClient:
    """Keep-alive pools to the nodes, per process. ``request`` sends; ``close`` ends every connection."""

    def __init__(self, *, connect_timeout_s: float, read_timeout_s: float, keepalive_s: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.keepalive_s = keepalive_s
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._busy: set[_Connection] = set()
        self._ssl: ssl.SSLContext | None = None
        self._sweeper = self.loop.call_later(keepalive_s, self._sweep)

    async def request(
        self, target: Target, headers: bytes, body: bytes = b"", *, fresh: bool = False
    ) -> UpstreamResponse:
        """Send ``target.head + headers`` (encoded lines) and the body; return at the response head.

        ``fresh`` skips the pool (a retry after a kept-alive connection was dropped under it).
        """
        conn = None if fresh else self._take(target.origin)
        if conn is None:
            conn = await self._connect(target)
        self._busy.add(conn)
        data = b"%s%scontent-length: %d\r\n\r\n%s" % (target.head, headers, len(body), body)
        try:
            waiter = conn.send(data)
        except (OSError, RuntimeError) as exc:  # closed under us between the pool and the write
            conn.abort()
            raise Disconnected(f"the connection to {target.host}:{target.port} closed: {exc}") from None
        conn.arm_read(waiter)
        try:
            return await waiter
        except BaseException:
            conn.abort()  # cancelled or failed mid-request: the node must see the connection go
            raise
        finally:
            conn.read_waiter = None

    def _take(self, origin: tuple[str, str, int]) -> _Connection | None:
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                return conn
        return None

    async def _connect(self, target: Target) -> _Connection:
        context = None
        if target.tls:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await self.loop.create_connection(
                    lambda: _Connection(self, target.origin),
                    target.host,
                    target.port,
                    ssl=context,
                    server_hostname=target.host if context is not None else None,
                )
        except TimeoutError:
            raise ConnectTimeout(f"no connection to {target.host}:{target.port} in time") from None
        except (OSError, ssl.SSLError) as exc:
            raise ConnectFailed(f"cannot connect to {target.host}:{target.port}: {exc}") from None
        return conn

    def release(self, conn: _Connection) -> None:
        """A response ended cleanly with keep-alive: the connection goes back to its pool."""
        self._busy.discard(conn)
        conn.idle_since = _monotonic()
        idle = self._idle.get(conn.origin)
        if idle is None:
            idle = self._idle[conn.origin] = []
        idle.append(conn)

    def forget(self, conn: _Connection) -> None:
        self._busy.discard(conn)
        idle = self._idle.get(conn.origin)
        if idle and conn in idle:
            idle.remove(conn)

    def _sweep(self) -> None:
        """Close connections idle longer than ``keepalive_s`` (checked every ``keepalive_s``)."""
        cutoff = time.monotonic() - self.keepalive_s
        for idle in self._idle.values():
            for conn in [c for c in idle if c.idle_since < cutoff]:
                idle.remove(conn)
                conn.abort()
        self._sweeper = self.loop.call_later(self.keepalive_s, self._sweep)

    def open_connections(self) -> int:
        return len(self._busy) + sum(len(idle) for idle in self._idle.values())

    async def close(self) -> None:
        self._sweeper.cancel()
        for conn in [*self._busy, *(c for idle in self._idle.values() for c in idle)]:
            conn.abort()
        self._idle.clear()
        self._busy.clear()
        await asyncio.sleep(0)  # let the transports finish closing
