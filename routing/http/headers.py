"""Which headers cross the gateway, and the request-side errors of the client side.

Header rules: hop-by-hop headers (RFC 9110 7.6.1, plus any the client names in ``Connection``)
never cross the gateway, nor do the headers the gateway sets itself; everything else passes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from routing.errors import GatewayError

# Never forwarded either way: hop-by-hop headers (RFC 9110 7.6.1) and ones the gateway sets itself.
_HOP_BY_HOP: Final = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te"}
    | {"trailer", "trailers", "transfer-encoding", "upgrade"}
)
_REQUEST_DROP: Final = _HOP_BY_HOP | {"host", "content-length", "content-type", "expect", "x-gorgo-region"}
_REQUEST_DROP_BYTES: Final = frozenset(name.encode() for name in _REQUEST_DROP)
_RESPONSE_DROP: Final = frozenset(
    name.encode()
    for name in _HOP_BY_HOP
    | {"date", "x-request-id", "x-gorgo-node", "x-gorgo-policy-version", "server-timing"}
)
_MAX_REQUEST_ID_CHARS: Final = 128  # a longer client X-Request-Id is replaced, not forwarded


def filter_response_headers(raw: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """A node's response headers minus hop-by-hop ones and those the gateway sets itself.

    Names arrive lower-cased (``UpstreamResponse.raw_headers``)."""
    return [(name, value) for name, value in raw if name not in _RESPONSE_DROP]


class ClientGone(Exception):
    """The client disconnected before its request body arrived."""


class RequestHeaders:
    """What one pass over the client's headers found.

    A plain class, not a dataclass: compiled, a dataclass's ``__init__`` is the Python function
    ``dataclasses`` wrote, called through the type (~2.5 k instructions a request); this one's is
    native (~0.2 k).
    """

    __slots__ = ("api_key", "authorization", "content_length", "forward", "request_id", "session_key")

    def __init__(self, forward: list[tuple[bytes, bytes]]) -> None:
        self.forward = forward  # (name, value) as the client sent them, to encode for the node
        self.request_id: str | None = None
        self.content_length: int | None = None
        self.session_key: str | None = None
        self.authorization: bytes | None = None
        self.api_key: bytes | None = None


_JSON: Final = (b"Content-Type", b"application/json")
_IDENTITY: Final = (b"Accept-Encoding", b"identity")


def scan_request_headers(
    raw: list[tuple[bytes, bytes]], session_header: str | None, *, keep_credentials: bool = True
) -> RequestHeaders:
    """One pass over the client's headers: what to forward, and what the gateway reads itself.

    With ``keep_credentials`` false (the gateway checks client keys itself) the client's key
    headers are not forwarded: nodes never see a client's secret. Names arrive lower-cased
    (``routing.http.client_side``) and values without CR or LF, so they are forwarded as bytes.
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


def too_large(max_bytes: int) -> GatewayError:
    """The 413 for a body over ``max_bytes``."""
    return GatewayError(413, f"The request body is larger than this gateway accepts ({max_bytes} bytes).")
