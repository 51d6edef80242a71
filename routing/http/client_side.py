"""The client side of the gateway: uvicorn's httptools protocol with a bound on everything.

uvicorn bounds none of these for httptools: the request head's size and header count (a 64 MB
header was buffered whole and forwarded), the time to send a request head or body (slow clients
held connections forever), a new connection that never sends anything (the keep-alive timer only
starts after a first response), and the number of open connections. ``GuardedHttpToolsProtocol``
adds each, answering like an HTTP server should and closing the connection:

| limit | setting | answer |
|---|---|---|
| request head bytes (request line + headers) | ``GORGO_CLIENT_MAX_HEADER_BYTES`` | 431 |
| header count | ``GORGO_CLIENT_MAX_HEADERS`` | 431 |
| head not complete in time (also a new, silent connection) | ``GORGO_CLIENT_HEADER_TIMEOUT_S`` | 408 |
| body not complete in time | ``GORGO_CLIENT_BODY_TIMEOUT_S`` | 408 |
| open connections per process | ``GORGO_MAX_CONNECTIONS`` | the oldest idle connection is closed; none idle: 503 + ``Retry-After`` |
| open connections per client address | ``GORGO_MAX_CONNECTIONS_PER_ADDRESS`` | that address's oldest idle connection is closed; none idle: 503 |
| a transfer coding other than ``chunked`` (e.g. ``gzip, chunked``) | | 501 |
| any other framing error (CL + TE, a bad chunk size, NUL in a header, an HTTP/2 preface) | | 400 |
| a client that reads none of its answer (its socket buffers full) | ``GORGO_CLIENT_SEND_TIMEOUT_S`` | connection cut; the request is cancelled (499) |

Every refusal is OpenAI-shaped JSON (``routing.errors``), like the app's own errors (uvicorn answered
framing errors ``400 text/plain "Invalid HTTP request received."``). A response sent before its
request's body was read whole (a 413, a 401 to a stranger) ends the connection: the rest of the
body is read and dropped for at most ``_LINGER_S`` (closing with it unread would reset the
connection and could destroy the answer in flight), then the connection closes. Before, it stayed
open until the body timeout.

Connection pressure (issue 22, item 3): 2,048 idle keep-alive connections from one unauthenticated
client used to fill ``GORGO_MAX_CONNECTIONS``, and every new client got 503. A connection is idle
while it is kept alive after an answer and has received no byte of a next request (a new connection
that never sent a request is not: the header timeout ends it, and the address cap bounds it); idle
connections are kept in one insertion-ordered dict, oldest first, so at the cap the oldest is
closed for the newcomer in O(1), and a connection with a request under way is never closed for
another. The per-address cap bounds what one client holds at all.

Request smuggling: httptools (llhttp) itself refuses a request with both ``Content-Length`` and
``Transfer-Encoding`` and one with two ``Content-Length`` headers (400); an unknown transfer
coding used to be ignored and the body read as chunked, so it is refused here (RFC 9112 6.1).

Memory stays bounded: the head is refused once it passes the limit (at most one read buffer
beyond it is ever held), bodies are paused by uvicorn's flow control and capped by
``GORGO_MAX_BODY_BYTES`` in the app, and every timer is cancelled with its connection.

The class is named by import string (``routing.http.client_side:GuardedHttpToolsProtocol``), so each worker
process builds it itself; it reads its limits from the environment once per process, and keeps
its counters (``ClientStats``) on the class, one set per process, which the gateway's metrics read.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

from routing.config import GatewayConfig
from routing.errors import GatewayError

# After an answer to a request whose body was not read whole: how long the rest may still arrive
# (read and dropped) before the connection closes, and how much of it is read.
_LINGER_S = 2.0
_LINGER_MAX_BYTES = 1 << 20


class ClientStats:
    """Counters of refused and timed-out clients, for /metrics."""

    __slots__ = (
        "body_timeouts",
        "by_address",
        "closing",
        "connections",
        "evicted_idle",
        "header_timeouts",
        "idle",
        "rejected_connections",
        "send_timeouts",
    )

    def __init__(self) -> None:
        self.send_timeouts = 0
        self.evicted_idle = 0  # idle connections closed to make room for a new one
        # Idle connections, oldest first (a dict keeps insertion order; re-insertion moves to the end).
        self.idle: dict[GuardedHttpToolsProtocol, None] = {}
        self.by_address: dict[str, int] = {}  # client address -> connections open from it
        self.closing = 0  # closed to make room, not yet gone from ``connections``
        self.rejected_connections = 0
        self.header_timeouts = 0
        self.body_timeouts = 0
        self.connections: set[Any] = set()  # uvicorn's own set of open connections, once known


class _HeadTooLarge(Exception):
    """Raised from a parser callback to stop parsing (httptools reports it as a parser error)."""


def _raw_response(error: GatewayError) -> bytes:
    body = error.body()
    reason = {
        400: b"Bad Request",
        408: b"Request Timeout",
        431: b"Request Header Fields Too Large",
        501: b"Not Implemented",
        503: b"Service Unavailable",
    }
    lines = [b"HTTP/1.1 %d %s" % (error.status, reason.get(error.status, b"Error"))]
    lines += [name + b": " + value for name, value in error.headers()]
    lines += [b"content-length: %d" % len(body), b"connection: close", b"", body]
    return b"\r\n".join(lines)


class CorkedTransport:
    """The client transport, with every write of one event-loop turn sent in one syscall.

    uvicorn writes a response's head and its body separately; a non-streaming answer (head and
    body sent in the same turn) so cost two ``send`` syscalls, each also running the loopback
    receiver's TCP path. Buffered until the end of the turn, they go out together; a stream's
    head still leaves at once (at the end of the turn that sent it, before any wait). Reads, flow
    control and everything else go to the real transport.
    """

    __slots__ = ("_buffer", "_loop", "_on_linger", "linger", "transport")

    def __init__(
        self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop, on_linger: Any = None
    ) -> None:
        self.transport = transport
        self._loop = loop
        self._buffer: list[bytes] = []
        # Set when an answer went out before its request's body was read whole: ``close`` then
        # half-closes and lets ``on_linger`` drain the rest before the real close.
        self.linger = False
        self._on_linger = on_linger

    def write(self, data: bytes) -> None:
        if not data:
            return
        if not self._buffer:
            self._loop.call_soon(self.flush)
        self._buffer.append(data)

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        buffer = self._buffer
        if buffer:
            self._buffer = []
            if not self.transport.is_closing():
                self.transport.write(buffer[0] if len(buffer) == 1 else b"".join(buffer))

    def is_closing(self) -> bool:
        return self.transport.is_closing()

    def close(self) -> None:
        self.flush()
        if self.linger and self._on_linger is not None and not self.transport.is_closing():
            self.linger = False
            if self.transport.can_write_eof():
                self.transport.write_eof()  # the client reads the answer, then end of file
            self._on_linger()
            return
        self.transport.close()

    def abort(self) -> None:
        self._buffer = []
        self.transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


class _Cycle(RequestResponseCycle):
    """uvicorn's request cycle, with the response head built without re-validating each header.

    uvicorn checks every response header name and value against two regular expressions (4 µs for
    the dozen headers of a gateway answer with rate-limit headers). A gateway answer's headers are
    the node's, already parsed by httptools (which refuses control characters), and the gateway's
    own. The rest (framing, keep-alive, flow control, bodies) is uvicorn's, unchanged, except:

    - a send that waits on a client not reading (flow control paused writing) longer than
      ``send_timeout_s`` cuts the connection: the app then hears a disconnect, and the proxy
      cancels the node's request. uvicorn waited forever (issue 22, item 7);
    - an answer that starts before the request body was read whole says ``connection: close``
      (the protocol closes the connection after it; see ``GuardedHttpToolsProtocol``).
    """

    send_timeout_s = 30.0  # set per cycle from the protocol's config

    async def send(self, message: Any) -> None:
        if self.flow.write_paused and not self.disconnected:
            try:
                async with asyncio.timeout(self.send_timeout_s):
                    await self.flow.drain()
            except TimeoutError:
                GuardedHttpToolsProtocol.stats.send_timeouts += 1
                self.disconnected = True
                self.message_event.set()  # receive() answers http.disconnect: the request ends
                self.transport.abort()
                return
        if self.more_body and not self.response_started and message["type"] == "http.response.start":
            self.keep_alive = False  # the rest of the body is not worth reading
            self.transport.linger = True  # type: ignore[attr-defined]
        if (
            self.response_started
            or message["type"] != "http.response.start"
            or self.disconnected
            or self.flow.write_paused
        ):
            await super().send(message)
            return
        self.response_started = True
        self.waiting_for_100_continue = False
        status_code = message["status"]
        content = [STATUS_LINE[status_code]]
        has_connection_close = False
        for raw_name, value in (*self.default_headers, *message.get("headers", ())):
            name = raw_name.lower()
            if name == b"content-length" and self.chunked_encoding is None:
                self.expected_content_length = int(value.decode())
                self.chunked_encoding = False
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                self.expected_content_length = 0
                self.chunked_encoding = True
            elif name == b"connection" and b"close" in [t.lower().strip() for t in value.split(b",")]:
                self.keep_alive = False
                has_connection_close = True
            content.extend((name, b": ", value, b"\r\n"))
        if not self.keep_alive and not has_connection_close:
            content.append(b"connection: close\r\n")
        if self.chunked_encoding is None and self.scope["method"] != "HEAD" and status_code not in (204, 304):
            self.chunked_encoding = True
            content.append(b"transfer-encoding: chunked\r\n")
        content.append(b"\r\n")
        self.transport.write(b"".join(content))


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol plus head limits, read timeouts and a connection cap."""

    stats = ClientStats()
    _config: GatewayConfig | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = GuardedHttpToolsProtocol._config
        if config is None:
            config = GuardedHttpToolsProtocol._config = GatewayConfig.from_env()
        self._max_head_bytes = config.client_max_header_bytes
        self._max_headers = config.client_max_headers
        self._header_timeout_s = config.client_header_timeout_s
        self._body_timeout_s = config.client_body_timeout_s
        self._max_connections = config.max_connections
        self._send_timeout_s = config.client_send_timeout_s
        self._max_connections_per_address = config.max_connections_per_address
        self._address = ""
        self._evicted = False
        self._lingering = -1  # bytes dropped since the answer, while lingering; -1: not lingering
        self._head_bytes = 0
        self._header_count = 0
        self._in_head = True
        self._refused = False
        self._head_too_large = False
        self._bad_coding = False
        # One lazy timer per connection: arming sets a deadline, and the timer handle is only
        # replaced when the new deadline is earlier than the one it will fire at (a request arms
        # and disarms twice, head then body: two call_later + cancel pairs per request before).
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = 0.0
        self._on_deadline: Any = None

    # ---- connections ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        stats = GuardedHttpToolsProtocol.stats
        stats.connections = self.connections
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        from_address = stats.by_address.get(address, 0)
        if from_address >= self._max_connections_per_address and not self._evict_idle(address):
            self._refuse_connection(transport, "Too many open connections from your address.")
            return
        if len(self.connections) - stats.closing >= self._max_connections and not self._evict_idle(None):
            self._refuse_connection(transport, "The gateway has too many open connections.")
            return
        self._address = address
        stats.by_address[address] = stats.by_address.get(address, 0) + 1
        super().connection_made(transport)
        self.transport = CorkedTransport(transport, self.loop, self._linger)  # type: ignore[assignment]
        self._arm(self._header_timeout_s, self._head_timed_out)  # a silent new connection too

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        if self._refused:
            return
        stats = GuardedHttpToolsProtocol.stats
        stats.idle.pop(self, None)
        if self._evicted:
            stats.closing -= 1
        left = stats.by_address.get(self._address, 1) - 1
        if left > 0:
            stats.by_address[self._address] = left
        else:
            stats.by_address.pop(self._address, None)
        super().connection_lost(exc)

    def _refuse_connection(self, transport: asyncio.Transport, message: str) -> None:
        self._refused = True
        GuardedHttpToolsProtocol.stats.rejected_connections += 1
        self.transport = transport
        transport.write(_raw_response(GatewayError(503, message, retry_after_s=1)))
        transport.close()

    def _evict_idle(self, address: str | None) -> bool:
        """Close the oldest idle connection (of ``address``, or of anyone) to make room for a new
        one; ``False`` when there is none."""
        stats = GuardedHttpToolsProtocol.stats
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
                GuardedHttpToolsProtocol.stats.idle.pop(self, None)  # a request has begun
            self._head_bytes += len(data)
        # uvicorn's data_received, except that a head over the limits gets 431, not 400.
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self._head_too_large:
                self._refuse(431, "The request head has too many or too large header fields.")
            elif self._bad_coding:
                self._refuse(501, "The only transfer coding this gateway accepts is chunked.")
            else:
                self._refuse(400, "Invalid HTTP request received.")
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        if self._in_head and self._head_bytes > self._max_head_bytes and not self.transport.is_closing():
            self._refuse(431, f"The request head is larger than {self._max_head_bytes} bytes.")

    # ---- parser callbacks --------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        GuardedHttpToolsProtocol.stats.idle.pop(self, None)  # a request has begun
        if not self._in_head:  # the next request on a kept-alive connection
            self._in_head = True
            self._head_bytes = 0
            self._header_count = 0
            self._arm(self._header_timeout_s, self._head_timed_out)

    def on_url(self, url: bytes) -> None:
        if len(self.url) + len(url) > self._max_head_bytes:
            self._head_too_large = True
            raise _HeadTooLarge
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self._max_headers:
            self._head_too_large = True
            raise _HeadTooLarge
        if name.lower() == b"transfer-encoding" and value.strip().lower() != b"chunked":
            self._bad_coding = True
            raise _HeadTooLarge  # stops the parser; answered with 501
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm()
        super().on_headers_complete()
        if type(self.cycle) is RequestResponseCycle:  # before its task runs: see _Cycle
            self.cycle.__class__ = _Cycle
            self.cycle.send_timeout_s = self._send_timeout_s  # type: ignore[attr-defined]
        if self.parser is not None and not self.transport.is_closing():
            self._arm(self._body_timeout_s, self._body_timed_out)

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        # uvicorn's, with the keep-alive wait on the connection's one deadline instead of a new
        # call_later per response (uvicorn cancels that in data_received, which finds none now).
        self.server_state.total_requests += 1
        if self.transport.is_closing() or self._lingering >= 0:
            return
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
        elif not self._in_head:  # (a next head already begun keeps its own, shorter timeout)
            self._arm(self.timeout_keep_alive, self.timeout_keep_alive_handler)
            GuardedHttpToolsProtocol.stats.idle[self] = None  # idle from now: newest last

    # ---- limits ------------------------------------------------------------------------------

    def _arm(self, seconds: float, callback: Any) -> None:
        self._deadline = deadline = self.loop.time() + seconds
        self._on_deadline = callback
        timer = self._timer
        if timer is not None:
            if timer.when() <= deadline:
                return  # it fires first and re-arms itself for the rest
            timer.cancel()
        self._timer = self.loop.call_at(deadline, self._fire)

    def _disarm(self) -> None:
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
        self._on_deadline = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_timed_out(self) -> None:
        if self.transport.is_closing():
            return
        GuardedHttpToolsProtocol.stats.header_timeouts += 1
        if self._head_bytes == 0:
            self.transport.close()  # a connection that never said anything gets no answer
            return
        self._refuse(408, f"The request head did not arrive within {self._header_timeout_s:g}s.")

    def _body_timed_out(self) -> None:
        cycle = self.cycle
        if self.transport.is_closing() or cycle is None or not cycle.more_body:
            return
        GuardedHttpToolsProtocol.stats.body_timeouts += 1
        if not cycle.response_started:
            error = GatewayError(408, f"The request body did not arrive within {self._body_timeout_s:g}s.")
            self.transport.write(_raw_response(error))
            cycle.response_complete = True
        cycle.disconnected = True  # the app sees a disconnect; its later sends are dropped
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's framing-error answer, in OpenAI's shape (it sent ``text/plain``)."""
        self._refuse(400, msg)

    def _refuse(self, status: int, message: str) -> None:
        self._disarm()
        cycle = self.cycle
        # Only an answer already under way is cut short without a word; a kept-alive
        # connection's earlier, finished answer does not stop this one (a bad second request).
        if cycle is not None and cycle.response_started and not cycle.response_complete:
            self.transport.close()
            return
        self.transport.write(_raw_response(GatewayError(status, message)))
        self.transport.close()

    def _linger(self) -> None:
        """An answer went out before its request body was read whole (a 413, a 401): drop what
        still arrives for at most ``_LINGER_S``, then close. Not reading it would reset the
        connection, which can destroy the answer before the client read it."""
        self._lingering = 0
        self.flow.resume_reading()
        self._arm(_LINGER_S, self._close_now)

    def _close_now(self) -> None:
        self._lingering = -1
        self._stop_timer()
        transport = self.transport
        if isinstance(transport, CorkedTransport):
            transport.transport.close()
        else:
            transport.close()
