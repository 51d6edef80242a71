"""The client side's deadlines, on a clock the test moves (no process, no sleeping).

A client that trickles its request head a byte at a time must not keep the connection: the head
has one deadline from the connection's start (``GORGO_CLIENT_HEADER_TIMEOUT_S``), and bytes that
arrive before it do not move it. The protocol's clock is its event loop (``loop.time`` and
``loop.call_at``): production passes the running loop, this test a manual one.
"""

from __future__ import annotations

from typing import Any

from routing.config import GatewayConfig
from routing.http.client_side import ClientConnection, ClientStats
from tests.routing.manual_loop import ManualLoop


class RecordingTransport:
    """A client connection: what the server wrote, and whether it hung up."""

    def __init__(self) -> None:
        self.written = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8100), "peername": ("127.0.0.1", 50000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def _handler(request: Any) -> None:  # never reached: no head completes
    raise AssertionError("no request should reach the handler")


def connection(loop: ManualLoop) -> tuple[ClientConnection, RecordingTransport]:
    config = GatewayConfig(
        region="us-east", gateway_id="gw", client_header_timeout_s=1.0, client_body_timeout_s=1.0
    )
    protocol = ClientConnection(_handler, config, ClientStats(), loop)  # type: ignore[arg-type]
    transport = RecordingTransport()
    protocol.connection_made(transport)  # type: ignore[arg-type]
    return protocol, transport


def test_a_head_trickled_a_byte_every_half_second_gets_408_at_its_deadline() -> None:
    loop = ManualLoop()
    protocol, transport = connection(loop)
    protocol.data_received(b"POST /v1/chat/completions HTTP/1.1\r\nHo")
    for _ in range(3):  # a byte every half second: never done in time
        loop.advance(0.5)
        if not transport.closed:
            protocol.data_received(b"x")
    assert transport.written.startswith(b"HTTP/1.1 408")
    assert transport.closed


def test_a_silent_connection_is_closed_without_a_word_at_the_head_deadline() -> None:
    loop = ManualLoop()
    _protocol, transport = connection(loop)
    loop.advance(0.9)
    assert not transport.closed  # not before its deadline
    loop.advance(0.2)
    assert transport.closed and transport.written == b""
