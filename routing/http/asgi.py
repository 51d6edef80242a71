"""The HTTP plumbing the gateway needs, on raw ASGI: headers, bodies, disconnects, responses.

Header rules: hop-by-hop headers (RFC 9110 7.6.1, plus any the client names in ``Connection``)
never cross the gateway, nor do the headers the gateway sets itself; everything else passes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, Protocol

from routing.deadlines import Deadline, FixedDelay
from routing.errors import GatewayError

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

# Never forwarded either way: hop-by-hop headers (RFC 9110 7.6.1) and ones the gateway sets itself.
_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te"}
    | {"trailer", "trailers", "transfer-encoding", "upgrade"}
)
_REQUEST_DROP = _HOP_BY_HOP | {"host", "content-length", "content-type", "expect", "x-gorgo-region"}
_REQUEST_DROP_BYTES = frozenset(name.encode() for name in _REQUEST_DROP)
_RESPONSE_DROP = frozenset(
    name.encode()
    for name in _HOP_BY_HOP
    | {"date", "x-request-id", "x-gorgo-node", "x-gorgo-policy-version", "server-timing"}
)
_MAX_REQUEST_ID_CHARS = 128  # a longer client X-Request-Id is replaced, not forwarded
_WATCH_AFTER_S = 0.05


class Watched(Protocol):
    """What ``DisconnectWatch`` reads and writes on the request it watches."""

    finished: bool  # the last byte is on its way: a disconnect now is not the client leaving
    client_gone: bool


def filter_response_headers(raw: tuple[tuple[bytes, bytes], ...]) -> list[tuple[bytes, bytes]]:
    """A node's response headers minus hop-by-hop ones and those the gateway sets itself."""
    return [(name, value) for name, value in raw if name.lower() not in _RESPONSE_DROP]


async def send_response(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    """A complete response with a Content-Length."""
    headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class ClientGone(Exception):
    """The client disconnected before its request body arrived."""


@dataclass(slots=True)
class RequestHeaders:
    """What one pass over the client's headers found."""

    forward: list[tuple[bytes, bytes]]  # (name, value) as the client sent them, to encode for the node
    request_id: str | None = None
    content_length: int | None = None
    session_key: str | None = None
    authorization: bytes | None = None
    api_key: bytes | None = None


_JSON = (b"Content-Type", b"application/json")
_IDENTITY = (b"Accept-Encoding", b"identity")


def scan_request_headers(
    raw: list[tuple[bytes, bytes]], session_header: str | None, *, keep_credentials: bool = True
) -> RequestHeaders:
    """One pass over the client's headers: what to forward, and what the gateway reads itself.

    With ``keep_credentials`` false (the gateway checks client keys itself) the client's key
    headers are not forwarded: nodes never see a client's secret. Names arrive lower-cased
    (httptools via uvicorn) and values without CR or LF, so they are forwarded as bytes.
    """
    forward: list[tuple[bytes, bytes]] = [_JSON]
    found = RequestHeaders(forward)
    session_name = session_header.encode() if session_header else None
    listed: set[bytes] = set()  # headers the client named in Connection: are hop-by-hop too
    accepts_encoding = False
    for name, value in raw:
        if name in _REQUEST_DROP_BYTES:
            if name == b"content-length":
                try:
                    found.content_length = int(value)
                except ValueError:
                    raise GatewayError(400, "Invalid Content-Length header.") from None
            elif name == b"connection":
                listed.update(token.strip().lower() for token in value.split(b","))
            continue
        if name == b"authorization" or name == b"api-key":
            if name == b"authorization":
                found.authorization = value
            else:
                found.api_key = value
            if not keep_credentials:
                continue
        elif name == b"x-request-id":
            text = value.decode("latin-1")
            if 0 < len(text) <= _MAX_REQUEST_ID_CHARS and text.isprintable():
                found.request_id = text
            continue  # re-added once, with the id we settle on
        elif name == session_name:
            found.session_key = value.decode("latin-1")
        elif name == b"accept-encoding":
            accepts_encoding = True
        forward.append((name, value))
    if listed:
        forward = found.forward = [(name, value) for name, value in forward if name not in listed]
    if not accepts_encoding:
        # Bodies pass through undecoded: never let a node compress for a client that did not ask.
        forward.append(_IDENTITY)
    return found


async def read_body(receive: Receive, content_length: int | None, max_bytes: int) -> bytes:
    """The whole request body; 413 as soon as it is known to exceed ``max_bytes``."""
    if content_length is not None and content_length > max_bytes:
        raise too_large(max_bytes)
    message = await receive()
    if message["type"] == "http.disconnect":
        raise ClientGone
    body = message.get("body", b"")
    if not message.get("more_body", False):
        if len(body) > max_bytes:
            raise too_large(max_bytes)
        return body
    parts = [body]
    size = len(body)
    while message.get("more_body", False):
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise too_large(max_bytes)
        parts.append(chunk)
    return b"".join(parts)


def too_large(max_bytes: int) -> GatewayError:
    """The 413 for a body over ``max_bytes``."""
    return GatewayError(413, f"The request body is larger than this gateway accepts ({max_bytes} bytes).")


class DisconnectWatch:
    """Cancels a request's task if its client goes away before the response is complete.

    Hearing a disconnect in ASGI takes a task blocked in ``receive()``. The task is only started
    once the request has waited ``_WATCH_AFTER_S``: every real generation lasts longer than that
    and gets watched, while fast answers (most of a benchmark) skip the cost of a task; a client
    that left earlier is still noticed then, because ``receive()`` returns at once.
    """

    __slots__ = ("_exchange", "_receive", "_task", "_timer", "_watcher")

    timers = FixedDelay(_WATCH_AFTER_S)  # one loop timer for every watch of the process

    def __init__(self, receive: Receive, exchange: Watched, task: asyncio.Task[Any]) -> None:
        self._receive = receive
        self._exchange = exchange
        self._task = task
        self._watcher: asyncio.Task[None] | None = None
        self._timer: Deadline | None = DisconnectWatch.timers.call(task.get_loop(), self._start)

    def _start(self) -> None:
        self._timer = None
        if self._task.done():
            return
        self._watcher = self._task.get_loop().create_task(self._watch())

    async def _watch(self) -> None:
        message = await self._receive()
        if message["type"] == "http.disconnect" and not self._exchange.finished:
            self._exchange.client_gone = True
            self._task.cancel()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._watcher is not None and not self._watcher.done():
            self._watcher.cancel()
