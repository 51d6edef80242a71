"""The client side of the gateway: an HTTP/1.1 server on httptools that calls the handler directly.

One ``ClientConnection`` (an ``asyncio.Protocol``) per client connection parses with httptools and
hands each request to the gateway as a ``ClientRequest``: the method, path and headers, the body
to await, and the answer to give (``respond`` for a whole one, ``start``/``write``/``end`` for a
stream). It replaced uvicorn's httptools protocol (issue 25): uvicorn's per-request ASGI cycle
(a scope dict, an ``asyncio.Event``, receive/send coroutines and a message dict per body part)
cost ~19 µs of the gateway's ~200 µs per request, and each limit below had been bolted onto it.

Every limit is the server's own, answered like an HTTP server should, closing the connection:

| limit | setting | answer |
|---|---|---|
| request head bytes (request line + headers) | ``GORGO_CLIENT_MAX_HEADER_BYTES`` | 431 |
| a chunked body's framing and trailer fields between two body bytes | ``GORGO_CLIENT_MAX_HEADER_BYTES`` | 431 |
| header count | ``GORGO_CLIENT_MAX_HEADERS`` | 431 |
| head not complete in time (also a new, silent connection) | ``GORGO_CLIENT_HEADER_TIMEOUT_S`` | 408 |
| body not complete in time | ``GORGO_CLIENT_BODY_TIMEOUT_S`` | 408 |
| open connections per process | ``GORGO_MAX_CONNECTIONS`` | the oldest idle connection is closed; none idle: 503 + ``Retry-After`` |
| open connections per client address | ``GORGO_MAX_CONNECTIONS_PER_ADDRESS`` | that address's oldest idle connection is closed; none idle: 503 |
| a transfer coding other than ``chunked`` (e.g. ``gzip, chunked``) | | 501 |
| any other framing error (CL + TE, a bad chunk size, NUL in a header, an HTTP/2 preface) | | 400 |
| a client that reads none of its answer (its socket buffers full) | ``GORGO_CLIENT_SEND_TIMEOUT_S`` | connection cut; the request is cancelled (499) |
| ... nor of the answers to its pipelined requests | ``GORGO_CLIENT_SEND_TIMEOUT_S`` | none is served or read meanwhile; then the connection is cut |

Every refusal is OpenAI-shaped JSON (``routing.errors``). A response sent before its request's
body was read whole (a 413, a 401 to a stranger) ends the connection: the rest of the body is read
and dropped for at most ``_LINGER_S`` (closing with it unread would reset the connection and could
destroy the answer in flight), then the connection closes.

Connection pressure (issue 22, item 3): a connection is idle while it is kept alive after an
answer and has received no byte of a next request; idle connections are kept in one
insertion-ordered dict, oldest first, so at the cap the oldest is closed for the newcomer in O(1),
and a connection with a request under way is never closed for another.

Request smuggling: httptools (llhttp) refuses a request with both ``Content-Length`` and
``Transfer-Encoding`` and one with two ``Content-Length`` headers (400); an unknown transfer
coding is refused here (501, RFC 9112 6.1). Trailer fields of a chunked body are dropped, never
merged into the head (RFC 9110 6.5.1).

HTTP/1.1 as clients need it: keep-alive (``GORGO_CLIENT_KEEPALIVE_S``), pipelining (answered in
order; reading pauses while a request waits its turn, and while the client's socket buffers are
full after an answer, so one read of requests and one answer past the transport's high-water mark
are the most a connection holds; the head or body deadline of a request the server holds unread
starts when reading resumes), ``Expect: 100-continue`` (the interim answer
when the handler first asks for the body), chunked request bodies, HEAD, streaming answers with
flow control (a write waits while the client's socket buffers are full; chunked, or to an HTTP/1.0
client, which knows no chunked coding, ended by closing the connection), and a client that hangs
up (or half-closes: TCP cannot tell the two apart) mid-request: the handler's ``on_disconnect``
runs, which cancels its task. A whole answer leaves in one ``transport.write`` (head and body
together); a stream's head is held to the end of its event-loop turn, so it leaves with the first
chunk when that is already there.
"""

from __future__ import annotations

import asyncio
import http
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Final, cast
from urllib.parse import unquote

import httptools

from routing.config import GatewayConfig
from routing.errors import GatewayError
from routing.http.headers import ClientGone, too_large

logger = logging.getLogger("routing.http")

# Module constants are ``Final``: compiled, each is then a C static, not a lookup in the module's
# dict (~150 instructions a use, dozens a request).
# After an answer to a request whose body was not read whole: how long the rest may still arrive
# (read and dropped) before the connection closes, and how much of it is read.
_LINGER_S: Final = 2.0
_LINGER_MAX_BYTES: Final = 1 << 20
# Request body bytes held before the handler asked for them: past this, reading pauses.
_BODY_HIGH_WATER_BYTES: Final = 1 << 16

STATUS_LINES: Final[dict[int, bytes]] = {
    int(status): b"HTTP/1.1 %d %s\r\n" % (status, http.HTTPStatus(status).phrase.encode())
    for status in http.HTTPStatus
    if status >= 100
}
_CONNECTION_CLOSE: Final = b"connection: close\r\n"
_CHUNKED: Final = b"transfer-encoding: chunked\r\n"
_LAST_CHUNK: Final = b"0\r\n\r\n"
_CONTINUE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"

Handler = Callable[["ClientRequest"], Awaitable[None]]

# An answer's header names go out lower-cased, as ``b"\r\nname: "`` (the line before's end with
# it): made once per distinct name (the gateway's own names and a node's are the same few on every
# answer) instead of a ``lower()`` call and four pieces per header and answer (~1 k instructions a
# header, compiled); two pieces a header, not three (~150 instructions a piece, its append and
# its share of the join). Bounded: a name past the cap is lowered each time.
_FIELD_STARTS: Final[dict[bytes, bytes]] = {}
_FIELD_STARTS_MAX: Final = 1024
_CONTENT_LENGTH_FIELD: Final = b"\r\ncontent-length: "
_CONNECTION_FIELD: Final = b"\r\nconnection: "
# The status lines without their line end (the first header field brings it).
_STATUS_STARTS: Final[dict[int, bytes]] = {status: line[:-2] for status, line in STATUS_LINES.items()}


def _field_start(name: bytes) -> bytes:
    field = b"\r\n" + name.lower() + b": "
    if len(_FIELD_STARTS) < _FIELD_STARTS_MAX:
        _FIELD_STARTS[name] = field
    return field


def field_start(name: bytes) -> bytes:
    """``b"\\r\\nname: "`` for a header field of an answer (``respond``'s ``own``), name lower-cased."""
    field = _FIELD_STARTS.get(name)
    return field if field is not None else _field_start(name)


def _handed(waiter: asyncio.Future[ClientRequest | None], request: ClientRequest) -> bool:
    """``waiter`` takes ``request``, unless it is done already (cancelled): no ``done()`` call
    first, which costs as much as the ``set_result`` (compiled, both are generic method calls)."""
    try:
        waiter.set_result(request)
    except asyncio.InvalidStateError:
        return False
    return True


class ClientStats:
    """One server's connections and its counters of refused and timed-out clients, for /metrics."""

    __slots__ = (
        "body_timeouts",
        "by_address",
        "closing",
        "connections",
        "drained",
        "evicted_idle",
        "header_timeouts",
        "idle",
        "rejected_connections",
        "requests",
        "send_timeouts",
    )

    def __init__(self) -> None:
        self.connections: set[ClientConnection] = set()
        self.requests: set[asyncio.Task[None]] = set()  # the handlers running, for a graceful stop
        # Idle connections, oldest first (a dict keeps insertion order; re-insertion moves to the end).
        self.idle: dict[ClientConnection, None] = {}
        self.by_address: dict[str, int] = {}  # client address -> connections open from it
        self.closing = 0  # closed to make room, not yet gone from ``connections``
        self.evicted_idle = 0  # idle connections closed to make room for a new one
        self.rejected_connections = 0
        self.header_timeouts = 0
        self.body_timeouts = 0
        self.send_timeouts = 0
        self.drained: asyncio.Event | None = None  # set when the last connection closed, while stopping


def raw_response(error: GatewayError) -> bytes:
    """A whole error answer that ends the connection (the server's own refusals)."""
    body = error.body()
    head = [STATUS_LINES.get(error.status, b"HTTP/1.1 %d Error\r\n" % error.status)]
    head += [name + b": " + value + b"\r\n" for name, value in error.headers()]
    head.append(b"content-length: %d\r\n%s\r\n" % (len(body), _CONNECTION_CLOSE))
    return b"".join(head) + body


class _Refused(Exception):
    """Raised from a parser callback to stop parsing (httptools reports it as a parser error)."""


class ClientRequest:
    """One request on a client connection, and its answer.

    The handler reads ``method``, ``path`` and ``headers`` (names lower-cased, values as sent),
    awaits ``body``, and answers once: ``respond`` (head and body in one write) or ``start``, then
    ``write`` per chunk and ``end`` (chunked unless a Content-Length was given). After the client
    left, answers go nowhere; ``disconnected`` says so, and ``on_disconnect`` (set by the
    handler) is called once when it happens while the answer is incomplete.
    """

    __slots__ = (
        "_body",
        "_body_bytes",
        "_body_waiter",
        "_chunked",
        "_connection",
        "_expect_continue",
        "_head",
        "_http_1_1",
        "_until_close",
        "disconnected",
        "headers",
        "keep_alive",
        "method",
        "more_body",
        "on_disconnect",
        "path",
        "response_complete",
        "response_started",
        "task",
    )

    def __init__(
        self,
        connection: ClientConnection,
        method: str,
        path: str,
        headers: list[tuple[bytes, bytes]],
        keep_alive: bool,
        expect_continue: bool,
        http_1_1: bool = True,
    ) -> None:
        self._connection = connection
        self.method = method
        self.path = path
        self.headers = headers
        self.keep_alive = keep_alive
        self._expect_continue = expect_continue
        self._body: list[bytes] = []
        self._body_bytes = 0
        self._body_waiter: asyncio.Future[None] | None = None
        self._chunked = False
        # HTTP/1.0 (or 0.9) knows no chunked coding (RFC 9112 6.1): a stream's body ends with the connection.
        self._http_1_1 = http_1_1
        self._until_close = False
        self._head: bytes | None = None  # a stream's head, until the end of the turn that started it
        self.more_body = True  # body bytes are still to come
        self.response_started = False
        self.response_complete = False
        self.disconnected = False
        self.on_disconnect: Callable[[], object] | None = None
        # The task the handler runs in (the connection's, set as it starts the handler): a
        # handler that needs it (to cancel on a disconnect) reads it here, not through Python 3.11's
        # ``asyncio.current_task``, a Python function (~1.5 k instructions a request).
        self.task: asyncio.Task[None] | None = None

    # ---- the request body --------------------------------------------------------------------

    async def body(self, content_length: int | None, max_bytes: int) -> bytes:
        """The whole request body; 413 as soon as it is known to exceed ``max_bytes``."""
        if content_length is not None and content_length > max_bytes:
            raise too_large(max_bytes)
        connection = self._connection
        if self._expect_continue:
            self._expect_continue = False
            if self.more_body and not self.disconnected:
                connection.transport.write(_CONTINUE)
        while self.more_body:
            if self.disconnected:
                raise ClientGone
            if self._body_bytes > max_bytes:
                raise too_large(max_bytes)
            connection.resume_reading()
            waiter = self._body_waiter = connection.loop.create_future()
            await waiter
        if self.disconnected:
            raise ClientGone
        parts = self._body
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        self._body = []
        if len(data) > max_bytes:
            raise too_large(max_bytes)
        return data

    def _received(self, data: bytes) -> None:
        self._body.append(data)
        self._body_bytes += len(data)
        if self._body_waiter is not None:
            self._wake()
        elif self._body_bytes > _BODY_HIGH_WATER_BYTES:
            self._connection.pause_reading()  # the handler has not asked yet: hold off

    def _wake(self) -> None:
        waiter, self._body_waiter = self._body_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # ---- the answer --------------------------------------------------------------------------

    def _head_bytes(
        self, status: int, headers: list[tuple[bytes, bytes]], length: int | None, own: bytes
    ) -> list[bytes]:
        self.response_started = True
        self._expect_continue = False
        if self.more_body:
            # An answer before the body was read whole (a 413, a 401): the rest is not worth
            # reading, so the connection ends after it (lingering to drop what still arrives).
            self.keep_alive = False
        head = [_STATUS_STARTS.get(status) or b"HTTP/1.1 %d " % status]
        for name, value in headers:
            field = _FIELD_STARTS.get(name)
            if field is None:
                field = _field_start(name)
            if field == _CONTENT_LENGTH_FIELD:
                continue  # framing is the server's: the length of the body it sends, or chunked
            if field == _CONNECTION_FIELD and b"close" in value.lower():
                self.keep_alive = False
            head.append(field)
            head.append(value)
        if own:
            head.append(own)
        if length is not None:
            head.append(b"\r\ncontent-length: %d\r\n" % length)
        else:
            head.append(b"\r\n")
        if not self.keep_alive:
            head.append(_CONNECTION_CLOSE)
        return head

    def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes, own: bytes = b"") -> None:
        """A whole answer with a Content-Length, head and body in one write.

        ``own``: header fields the caller wrote itself, after ``headers``, each as
        ``b"\\r\\nname: value"`` (``field_start(name) + value``): names lower-case, and never
        Content-Length or Connection (the server's), so they go out as they are.
        """
        if self.response_started:
            raise RuntimeError("the answer was already started")
        if self.disconnected:  # the client is gone (or the server refused it): nothing goes out
            self.response_started = True
            self._complete()
            return
        head = self._head_bytes(status, headers, len(body), own)
        head.append(b"\r\n")
        if self.method != "HEAD":
            head.append(body)
        if not self.disconnected:
            self._connection.transport.write(b"".join(head))
        self._complete()

    def start(self, status: int, headers: list[tuple[bytes, bytes]], own: bytes = b"") -> None:
        """The head of a streamed answer (chunked; to an HTTP/1.0 client, ended by closing the
        connection), sent at the end of this event-loop turn (``own`` as for ``respond``)."""
        if self.response_started:
            raise RuntimeError("the answer was already started")
        if self.disconnected:
            self.response_started = True
            return
        has_body = self.method != "HEAD" and status not in (204, 304)
        if has_body and not self._http_1_1:
            self.keep_alive = False  # the end of file ends its body
            self._until_close = True
        head = self._head_bytes(status, headers, None, own)
        self._chunked = has_body and self._http_1_1
        if self._chunked:
            head.append(_CHUNKED)
        head.append(b"\r\n")
        self._head = b"".join(head)
        self._connection.loop.call_soon(self._flush_head)

    def _flush_head(self) -> None:
        head, self._head = self._head, None
        if head is not None and not self.disconnected:
            self._connection.transport.write(head)

    async def write(self, chunk: bytes) -> None:
        """One chunk of a streamed answer; waits while the client is not reading (flow control)."""
        if self.disconnected or not chunk:
            return
        if self._chunked:
            data = b"%x\r\n%s\r\n" % (len(chunk), chunk)
        elif self._until_close:
            data = chunk
        else:
            return  # an answer without a body (HEAD, 204, 304)
        connection = self._connection
        if connection.write_paused:
            await connection.drain(self)
            if self.disconnected:
                return
        head, self._head = self._head, None
        connection.transport.write(data if head is None else head + data)

    def end(self) -> None:
        """The end of a streamed answer."""
        if not self.disconnected:
            head, self._head = self._head, None
            tail = _LAST_CHUNK if self._chunked else b""
            data = tail if head is None else head + tail
            if data:
                self._connection.transport.write(data)
        self._complete()

    def _complete(self) -> None:
        if self.response_complete:
            return
        self.response_complete = True
        self._connection.response_complete(self)

    def _lost(self) -> None:
        """The connection is gone before the answer was complete."""
        self.disconnected = True
        self._wake()
        callback, self.on_disconnect = self.on_disconnect, None
        if callback is not None and not self.response_complete:
            callback()


class ClientConnection(asyncio.Protocol):
    """One client connection: parse, bound, dispatch to the handler, keep alive."""

    def __init__(
        self,
        handler: Handler,
        config: GatewayConfig,
        stats: ClientStats,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self._handler = handler
        self._stats = stats
        # The connection's clock and scheduler: the running loop (a test passes a manual one).
        self.loop = loop if loop is not None else asyncio.get_running_loop()
        self._max_head_bytes = config.client_max_header_bytes
        self._max_headers = config.client_max_headers
        self._header_timeout_s = config.client_header_timeout_s
        self._body_timeout_s = config.client_body_timeout_s
        self._keepalive_s = config.client_keepalive_s
        self._send_timeout_s = config.client_send_timeout_s
        self._max_connections = config.max_connections
        self._max_connections_per_address = config.max_connections_per_address
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self._parser = httptools.HttpRequestParser(self)
        self._address = ""
        self._refused = False
        self._evicted = False
        self._closing = False  # the server is shutting down: no request after the one under way
        self._lingering = -1  # bytes dropped since the answer, while lingering; -1: not lingering
        self._read_paused = False
        self.write_paused = False
        # An answer went out while the client's buffers were full: no next request until it reads.
        self._held = False
        self._drain_waiter: asyncio.Future[None] | None = None
        # The request being parsed, the one being answered and those waiting their turn.
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._field_bytes = 0  # the header fields' bytes so far (name, value, ": " and CRLF each)
        self._expect_continue = False
        self._parsing: ClientRequest | None = None
        self._current: ClientRequest | None = None
        self._pipeline: deque[ClientRequest] = deque()
        # The task that runs this connection's handlers, one request after the other (see
        # ``_serve``); while it waits for the next request, the future that hands it over; a
        # request begun while it still finishes the one before (pipelined), the one it takes next.
        self._task: asyncio.Task[None] | None = None
        self._waiter: asyncio.Future[ClientRequest | None] | None = None
        self._next: ClientRequest | None = None
        self._head_bytes = 0
        self._in_head = True
        self._head_error: tuple[int, str] | None = None
        # Bytes read within a request's body since its last body byte (chunk framing, trailer
        # fields, which the parser holds whole until their line ends): bounded like the head.
        # -1: the head or a body byte came in the read being parsed.
        self._framing_bytes = 0
        # One lazy timer per connection: arming sets a deadline, and the timer handle is only
        # replaced when the new deadline is earlier than the one it will fire at.
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = 0.0
        self._on_deadline: Callable[[], None] | None = None
        # A deadline the parser's callbacks asked for, armed when ``data_received`` is done with
        # its bytes: a whole request in one read asks for the head's, then the body's, then none
        # (~1.6 k instructions a request: each arming reads the loop's clock and the timer's).
        # No timer runs meanwhile, and the loop's clock stands still within a callback.
        self._pending_s = 0.0
        self._pending: Callable[[], None] | None = None

    # ---- connections ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no asyncio.Transport
        stats = self._stats
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        from_address = stats.by_address.get(address, 0)
        if from_address >= self._max_connections_per_address and not self._evict_idle(address):
            self._refuse_connection("Too many open connections from your address.")
            return
        if len(stats.connections) - stats.closing >= self._max_connections and not self._evict_idle(None):
            self._refuse_connection("The gateway has too many open connections.")
            return
        self._address = address
        stats.by_address[address] = from_address + 1
        stats.connections.add(self)
        self._arm(self._header_timeout_s, self._head_timed_out)  # a silent new connection too

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        if self._refused:
            return
        stats = self._stats
        stats.connections.discard(self)
        if stats.drained is not None and not stats.connections:
            stats.drained.set()
        stats.idle.pop(self, None)
        if self._evicted:
            stats.closing -= 1
        left = stats.by_address.get(self._address, 1) - 1
        if left > 0:
            stats.by_address[self._address] = left
        else:
            stats.by_address.pop(self._address, None)
        self.write_paused = False
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_result(None)
        self._pipeline.clear()
        request = self._current
        if request is not None and not request.response_complete:
            request._lost()
        self._parser = None  # type: ignore[assignment]
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)  # the connection's task ends

    def eof_received(self) -> bool | None:
        # A FIN mid-request counts as the client gone (hyper's and nginx's default); an idle
        # half-closed connection is closed. Returning None closes the transport.
        return None

    def _refuse_connection(self, message: str) -> None:
        self._refused = True
        self._stats.rejected_connections += 1
        self.transport.write(raw_response(GatewayError(503, message, retry_after_s=1)))
        self.transport.close()

    def _evict_idle(self, address: str | None) -> bool:
        """Close the oldest idle connection (of ``address``, or of anyone) to make room for a new
        one; ``False`` when there is none."""
        stats = self._stats
        victim = None
        for candidate in stats.idle:
            if address is None or candidate._address == address:
                victim = candidate
                break
        if victim is None:
            return False
        del stats.idle[victim]
        victim._evicted = True
        stats.closing += 1
        stats.evicted_idle += 1
        victim._stop_timer()
        victim.transport.close()
        return True

    def shutdown(self) -> None:
        """The server is stopping: close now if idle, else after the answer under way."""
        self._closing = True
        if self._current is None and self._parsing is None:
            self.transport.close()

    # ---- flow control ------------------------------------------------------------------------

    def pause_reading(self) -> None:
        if not self._read_paused:
            self._read_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._read_paused and self._lingering < 0:
            self._read_paused = False
            self.transport.resume_reading()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        waiter, self._drain_waiter = self._drain_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if self._held and not self.transport.is_closing():
            self._held = False  # the client reads again: its next request's turn
            self._disarm()
            self._serve_next()

    async def drain(self, request: ClientRequest) -> None:
        """Wait until the client reads again; past the send timeout, cut the connection (the
        handler hears a disconnect and cancels the node's request: issue 22, item 7)."""
        waiter = self._drain_waiter
        if waiter is None:
            waiter = self._drain_waiter = self.loop.create_future()
        try:
            async with asyncio.timeout(self._send_timeout_s):
                await asyncio.shield(waiter)
        except TimeoutError:
            self._stats.send_timeouts += 1
            request.disconnected = True
            self.transport.abort()  # connection_lost follows, which calls on_disconnect

    # ---- bytes in ----------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._lingering >= 0:
            self._lingering += len(data)
            if self._lingering > _LINGER_MAX_BYTES:
                self._close_now()
            return
        if self._in_head:
            if self._head_bytes == 0:
                self._stats.idle.pop(self, None)  # a request has begun
            self._head_bytes += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # no protocol upgrades here: the request was served as HTTP/1.1
        except httptools.HttpParserError:
            if self._head_error is not None:
                self._refuse(*self._head_error)
            else:
                self._refuse(400, "Invalid HTTP request received.")
            return
        if self._in_head and self._head_bytes > self._max_head_bytes and not self.transport.is_closing():
            self._refuse(431, f"The request head is larger than {self._max_head_bytes} bytes.")
            return
        if self._parsing is not None:  # within a body
            framing = self._framing_bytes
            framing = self._framing_bytes = 0 if framing < 0 else framing + len(data)
            if framing > self._max_head_bytes and not self.transport.is_closing():
                self._refuse(
                    431,
                    "The request body's chunk framing or trailer fields are larger than "
                    f"{self._max_head_bytes} bytes.",
                )
                return
        pending = self._pending
        if pending is not None:
            self._pending = None
            if self._pipeline:
                # Held: reading pauses while a request waits its turn, so the client cannot send
                # the rest; its deadline starts when reading resumes (``_restart_deadline``).
                self._on_deadline = None
            else:
                self._arm(self._pending_s, pending)

    # ---- parser callbacks --------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._stats.idle.pop(self, None)
        self._url = b""
        self._headers = []
        self._field_bytes = 0
        self._expect_continue = False
        if not self._in_head:  # the next request on a kept-alive connection
            self._in_head = True
            self._head_bytes = 0
            self._pending_s = self._header_timeout_s
            self._pending = self._head_timed_out

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > self._max_head_bytes:
            self._head_error = (431, "The request head has too many or too large header fields.")
            raise _Refused

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._in_head:
            return  # a trailer field, after a chunked body: never merged into the head (RFC 9110 6.5.1)
        headers = self._headers
        # The head's size, counted by field: the bytes read per read are counted only while a
        # head is incomplete, which misses a head that completes within one read.
        field_bytes = self._field_bytes = self._field_bytes + len(name) + len(value) + 4
        if len(headers) >= self._max_headers or field_bytes + len(self._url) > self._max_head_bytes:
            self._head_error = (431, "The request head has too many or too large header fields.")
            raise _Refused
        name = name.lower()
        if name == b"transfer-encoding" and value.strip().lower() != b"chunked":
            self._head_error = (501, "The only transfer coding this gateway accepts is chunked.")
            raise _Refused
        if name == b"expect" and value.lower() == b"100-continue":
            self._expect_continue = True
        headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._in_head = False
        parser = self._parser
        url = self._url
        # The usual origin-form path needs no parsing. Checked on the str: compiled, a str's
        # ``in`` is a primitive, a bytes' goes through the buffer protocol (~2 k instructions).
        path = url.decode("latin-1")
        if path[:1] != "/" or "?" in path or "%" in path:
            try:
                path = unquote(httptools.parse_url(url).path.decode("latin-1"))
            except httptools.HttpParserInvalidURLError:
                pass  # answered 404 by the gateway, as it came
        keep_alive = parser.should_keep_alive() and not self._closing
        request = ClientRequest(
            self,
            parser.get_method().decode("latin-1"),
            path,
            self._headers,
            keep_alive,
            self._expect_continue,
            parser.get_http_version() == "1.1",
        )
        self._parsing = request
        self._framing_bytes = -1
        self._pending_s = self._body_timeout_s
        self._pending = self._body_timed_out
        if self._current is None and not self._held:
            self._begin(request)
        else:
            self.pause_reading()  # a pipelined request waits its turn
            self._pipeline.append(request)

    def on_body(self, body: bytes) -> None:
        self._framing_bytes = -1
        request = self._parsing
        if request is not None and not request.response_complete:
            request._received(body)

    def on_message_complete(self) -> None:
        self._disarm()
        request, self._parsing = self._parsing, None
        if request is not None:
            request.more_body = False
            request._wake()

    # ---- requests ----------------------------------------------------------------------------

    def _begin(self, request: ClientRequest) -> None:
        self._current = request
        waiter, self._waiter = self._waiter, None
        task = self._task
        if task is not None and waiter is not None and _handed(waiter, request):
            pass  # the connection's task waits for it
        elif task is not None and waiter is None and not task.done():
            self._next = request  # the task still finishes the request before: this one is next
        else:
            task = self._task = self.loop.create_task(self._serve(request))
        self._stats.requests.add(task)

    async def _serve(self, request: ClientRequest) -> None:
        """The connection's task: its requests' handlers, one after the other.

        One task per connection, not per request: creating a task costs ~9 k instructions (of
        ~300 k a request; Python 3.11 adds each task to a ``WeakSet`` in Python code, and its
        weak reference's callback removes it again), handing a request to a waiting task ~1 k.
        A request's cancellation stays its own: a task with a cancellation still pending (or
        caught and not uncancelled) when a request ends serves no other, the next one gets a
        new task.
        """
        task: asyncio.Task[None] | None = asyncio.current_task(self.loop)
        assert task is not None
        stats = self._stats
        next_request: ClientRequest | None = request
        try:
            while next_request is not None:
                request = next_request
                request.task = task
                # The handler inline, not a coroutine of its own: one layer less to resume it
                # through, each time it waits.
                try:
                    await self._handler(request)
                except BaseException as exc:
                    if not isinstance(exc, asyncio.CancelledError):
                        logger.exception("the handler failed on %s %s", request.method, request.path)
                    if not request.response_started:
                        error = GatewayError(500, "Internal gateway error.")
                        request.keep_alive = False
                        request.respond(500, error.headers(), error.body())
                    else:
                        self.transport.close()
                    if not isinstance(exc, Exception):
                        raise
                else:
                    if not request.response_complete and not request.disconnected:
                        logger.error("the handler returned without finishing its answer: %s", request.path)
                        self.transport.close()
                if task.cancelling():
                    return
                next_request, self._next = self._next, None
                if next_request is None:
                    stats.requests.discard(task)
                    if self._parser is None:
                        return  # the connection is gone: no request will follow
                    # A closing transport's ``connection_lost`` follows, and wakes this with None.
                    waiter = self._waiter = self.loop.create_future()
                    next_request = await waiter
        finally:
            stats.requests.discard(task)
            if self._task is task:
                self._task = None
                self._waiter = None
                pending, self._next = self._next, None
                if pending is not None:
                    self._begin(pending)  # begun while this task ended: a task of its own
            # The task keeps this coroutine, whose environment keeps the task: a cycle per
            # connection left to the garbage collector, unless broken here.
            task = None

    def response_complete(self, request: ClientRequest) -> None:
        """The answer to ``request`` went out: linger, close, or serve the next one."""
        self._current = None
        transport = self.transport
        if transport.is_closing():
            return
        if request.more_body and not request.disconnected:
            self._linger()
            return
        if not request.keep_alive or self._closing:
            transport.close()
            return
        if self.write_paused:
            # The client reads none of its answers: serve (and read) nothing more until it does,
            # or a client pipelining cheap requests piles their answers up here without bound.
            self._held = True
            self.pause_reading()
            self._arm(self._send_timeout_s, self._held_timed_out)
            return
        self._serve_next()

    def _serve_next(self) -> None:
        pipeline = self._pipeline
        if pipeline:
            self._begin(pipeline.popleft())
            if pipeline:
                # Reading stays paused while others wait their turn: the parser is past them
                # already, and each read would queue more (a client sending requests without
                # end held 700,000 of them after 5 s).
                return
        if self._read_paused:
            self.resume_reading()
            self._restart_deadline()
        if self._current is None and self._parsing is None and not self._in_head:
            # No byte of a next request yet (a begun head keeps its own, shorter timeout).
            self._arm(self._keepalive_s, self._keepalive_ended)
            self._stats.idle[self] = None  # idle from now: newest last

    # ---- limits ------------------------------------------------------------------------------

    def _arm(self, seconds: float, callback: Callable[[], None]) -> None:
        self._deadline = deadline = self.loop.time() + seconds
        self._on_deadline = callback
        timer = self._timer
        if timer is not None:
            if timer.when() <= deadline:
                return  # it fires first and re-arms itself for the rest
            timer.cancel()
        self._timer = self.loop.call_at(deadline, self._fire)

    def _disarm(self) -> None:
        self._pending = None
        self._on_deadline = None  # the timer, if any, fires into nothing (or is reused)

    def _fire(self) -> None:
        self._timer = None
        callback = self._on_deadline
        if callback is None or self.transport is None:
            return
        if self._deadline > self.loop.time():
            self._timer = self.loop.call_at(self._deadline, self._fire)
            return
        self._on_deadline = None
        callback()

    def _stop_timer(self) -> None:
        self._pending = None
        self._on_deadline = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _keepalive_ended(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()

    def _restart_deadline(self) -> None:
        """Reading resumes after the server held it: what is being parsed gets its deadline from
        now (the client could not send it while nothing was read)."""
        if self._parsing is not None:
            self._arm(self._body_timeout_s, self._body_timed_out)
        elif self._in_head:
            self._arm(self._header_timeout_s, self._head_timed_out)

    def _held_timed_out(self) -> None:
        if self.transport.is_closing():
            return
        self._stats.send_timeouts += 1
        self.transport.abort()  # its answers cannot leave: what is buffered for it goes too

    def _head_timed_out(self) -> None:
        if self.transport.is_closing():
            return
        self._stats.header_timeouts += 1
        if self._head_bytes == 0:
            self.transport.close()  # a connection that never said anything gets no answer
            return
        self._refuse(408, f"The request head did not arrive within {self._header_timeout_s:g}s.")

    def _body_timed_out(self) -> None:
        request = self._parsing
        if self.transport.is_closing() or request is None or not request.more_body:
            return
        self._stats.body_timeouts += 1
        if request is self._current and not request.response_started:
            error = GatewayError(408, f"The request body did not arrive within {self._body_timeout_s:g}s.")
            self.transport.write(raw_response(error))
        request.disconnected = True  # its answers are dropped
        self.transport.close()  # the handler hears a disconnect; its later answers are dropped

    def _refuse(self, status: int, message: str) -> None:
        self._disarm()
        request = self._current
        # Only an answer already under way is cut short without a word; a kept-alive
        # connection's earlier, finished answer does not stop this one (a bad second request).
        if request is not None and request.response_started and not request.response_complete:
            self.transport.close()
            return
        if request is not None:
            request.disconnected = True  # the handler's answer is dropped; it hears a disconnect
        self.transport.write(raw_response(GatewayError(status, message)))
        self.transport.close()

    def _linger(self) -> None:
        """An answer went out before its request body was read whole (a 413, a 401): drop what
        still arrives for at most ``_LINGER_S``, then close. Not reading it would reset the
        connection, which can destroy the answer before the client read it."""
        self._lingering = 0
        self._pipeline.clear()
        if self.transport.can_write_eof():
            self.transport.write_eof()  # the client reads the answer, then end of file
        if self._read_paused:
            self._read_paused = False
            self.transport.resume_reading()
        self._arm(_LINGER_S, self._close_now)

    def _close_now(self) -> None:
        self._lingering = -1
        self._stop_timer()
        self.transport.close()


def connection_factory(handler: Handler, config: GatewayConfig, stats: ClientStats) -> Callable[[], Any]:
    """What ``loop.create_server`` calls per accepted connection."""
    return lambda: ClientConnection(handler, config, stats)
