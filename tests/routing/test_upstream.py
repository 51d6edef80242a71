"""The gateway's own upstream client (routing/http/upstream.py) and its fixed-delay timers, on real sockets."""

from __future__ import annotations

import asyncio

import pytest

from routing.deadlines import FixedDelay
from routing.http.headers import filter_response_headers
from routing.http.upstream import ConnectFailed, ProtocolError, ReadTimeout, UpstreamClient, make_target
from simulator.harness import free_port
from tests.routing.manual_loop import ManualLoop
from tests.routing.support import wait_for

CHAT = "/v1/chat/completions"


class Server:
    """A scripted HTTP peer: ``answer(request_bytes) -> list of (delay_s, bytes | None)``; None closes."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.connections = 0
        self.server: asyncio.base_events.Server | None = None

    async def __aenter__(self) -> str:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                while data := await reader.read(65536):
                    for delay_s, chunk in self.answer(data):
                        await asyncio.sleep(delay_s)
                        if chunk is None:
                            writer.close()
                            return
                        writer.write(chunk)
            except (ConnectionError, asyncio.CancelledError):
                pass

        self.server = await asyncio.start_server(handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()


def ok(body: bytes = b'{"ok":true}') -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )


def client(read_timeout_s: float = 5.0) -> UpstreamClient:
    return UpstreamClient(connect_timeout_s=1.0, read_timeout_s=read_timeout_s, keepalive_s=60.0)


async def test_keep_alive_reuses_one_connection_and_sends_head_and_body():
    seen: list[bytes] = []

    def answer(data: bytes):
        seen.append(data)
        return [(0, ok())]

    async with Server(answer) as url:
        upstream = client()
        target = make_target(url + CHAT)
        for _ in range(3):
            response = await upstream.request(target, b"X-A: 1\r\n", b"{}")
            assert response.status == 200 and response.content_type == "application/json"
            assert await response.read() == b'{"ok":true}'
        assert upstream.open_connections() == 1
        await upstream.close()
    assert seen[0].startswith(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:")
    assert seen[0].endswith(b"X-A: 1\r\ncontent-length: 2\r\n\r\n{}")


async def test_it_hands_over_a_nodes_header_names_lower_cased():
    # The relay's filter and the client side's answer head compare names without lowering them
    # again (routing/http/headers.py): a node's "Keep-Alive" or "Date" must still be caught.
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nDate: x\r\nKeep-Alive: timeout=5\r\n"
    async with Server(lambda data: [(0, head + b"X-Custom: A\r\nContent-Length: 2\r\n\r\n{}")]) as url:
        upstream = client()
        response = await upstream.request(make_target(url + CHAT), b"", b"{}")
        assert await response.read() == b"{}"
        assert response.raw_headers == [
            (b"content-type", b"application/json"),
            (b"date", b"x"),
            (b"keep-alive", b"timeout=5"),
            (b"x-custom", b"A"),
            (b"content-length", b"2"),
        ]
        assert filter_response_headers(response.raw_headers) == [
            (b"content-type", b"application/json"),
            (b"x-custom", b"A"),
            (b"content-length", b"2"),
        ]
        await upstream.close()


async def test_a_silent_node_times_out_before_and_during_the_body():
    def silent(_data: bytes):
        return [(10, b"")]

    async with Server(silent) as url:
        upstream = client(read_timeout_s=0.2)
        with pytest.raises(ReadTimeout):
            await upstream.request(make_target(url + CHAT), b"", b"{}")
        await upstream.close()

    def stalls(_data: bytes):
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        return [(0, head + b"5\r\nhello\r\n"), (10, b"")]

    async with Server(stalls) as url:
        upstream = client(read_timeout_s=0.2)
        response = await upstream.request(make_target(url + CHAT), b"", b"{}")
        assert response.content_type == "text/event-stream"
        assert await response.readany() == b"hello"
        with pytest.raises(ReadTimeout):
            await response.readany()
        response.close()
        await upstream.close()


async def test_a_body_delimited_by_the_close_is_read_whole_and_the_connection_not_reused():
    def answer(_data: bytes):
        return [
            (0, b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{"a":'),
            (0.05, b"1}"),
            (0, None),
        ]

    async with Server(answer) as url:
        upstream = client()
        response = await upstream.request(make_target(url + CHAT), b"", b"{}")
        assert await response.read() == b'{"a":1}'
        await wait_for(lambda: upstream.open_connections() == 0)  # the close is processed
        assert upstream.open_connections() == 0
        await upstream.close()


async def test_large_bodies_arrive_whole_read_at_once_or_chunk_by_chunk():
    big = b"x" * (3 << 20)  # past the flow-control high-water mark

    def answer(_data: bytes):
        return [(0, ok(big))]

    async with Server(answer) as url:
        upstream = client()
        target = make_target(url + CHAT)
        response = await upstream.request(target, b"", b"{}")
        await wait_for(lambda: response._paused)  # past the high-water mark: reading paused before asking
        assert await response.read() == big
        response = await upstream.request(target, b"", b"{}")
        received = b""
        while chunk := await response.readany():
            received += chunk
        assert received == big
        await upstream.close()


async def test_a_refused_connection_is_connect_failed():
    upstream = client()
    with pytest.raises(ConnectFailed):
        await upstream.request(make_target(f"http://127.0.0.1:{free_port()}{CHAT}"), b"", b"{}")
    await upstream.close()


async def test_fixed_delay_timers_fire_in_order_and_cancelled_ones_not():
    loop = ManualLoop()
    timers = FixedDelay(0.05)
    fired: list[int] = []
    entries = [timers.call(loop, lambda i=i: fired.append(i)) for i in range(5)]  # type: ignore[arg-type]
    entries[0].cancel()
    entries[3].cancel()
    loop.advance(0.15)
    assert fired == [1, 2, 4]
    timers.call(loop, lambda: fired.append(9))  # type: ignore[arg-type]
    loop.advance(0.1)
    assert fired == [1, 2, 4, 9]


async def test_an_endless_response_head_is_refused_without_buffering_it():
    """A node that never ends its head (one endless header field) was read until the read
    timeout: httptools held the field whole and grew it by a copy per read (gigabytes of copying
    on the event loop, all of it kept in memory). Now a head past 64 KiB is a protocol error."""
    sent = {"bytes": 0}

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(65536)
        filler = b"a" * 65536
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-filler: ")
        try:
            for _ in range(512):  # at most 32 MB
                writer.write(filler)
                await writer.drain()
                sent["bytes"] += len(filler)
        except ConnectionError:
            pass
        writer.close()

    server = await asyncio.start_server(endless, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    upstream = client(read_timeout_s=3.0)
    try:
        with pytest.raises(ProtocolError):
            await upstream.request(make_target(url + CHAT), b"", b"{}")
    finally:
        await upstream.close()
        server.close()
    assert sent["bytes"] < 16 << 20


@pytest.mark.parametrize("status_line", [b"HTTP/1.1 000 OK", b"HTTP/1.1 099 Odd"])
async def test_a_status_below_100_is_a_protocol_error(status_line):
    """httptools takes any three digits: a 000 was taken for the end of an interim answer, so the
    body never ended (the request waited for the read timeout), and a 099 went to the client."""
    answer = status_line + b"\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
    async with Server(lambda data: [(0, answer)]) as url:
        upstream = client(read_timeout_s=1.0)
        with pytest.raises(ProtocolError):
            response = await upstream.request(make_target(url + CHAT), b"", b"{}")
            await response.read()
        await upstream.close()


@pytest.mark.parametrize("trailer", ["many fields", "one endless field"])
async def test_an_endless_trailer_is_refused_without_buffering_it(trailer: str):
    """A chunked answer may end with trailer fields, which HTTP does not bound. A node that sent
    them without end (many fields, or one field that never ends) was read until the read timeout
    and all of it kept: the fields grew the response's header list, an endless one was held and
    copied by httptools at each read. Now an answer that is far more framing than body after its
    head is a protocol error, and a normal stream of small chunks is not."""
    sent = {"bytes": 0}

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(65536)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            b"5\r\nhello\r\n0\r\n" + (b"x-endless: " if trailer == "one endless field" else b"")
        )
        filler = b"x-t: " + b"a" * 1000 + b"\r\n" if trailer == "many fields" else b"a" * 1024
        try:
            for _ in range(32 * 1024):  # at most ~32 MB
                writer.write(filler * 64)
                await writer.drain()
                sent["bytes"] += len(filler) * 64
        except ConnectionError:
            pass
        writer.close()

    server = await asyncio.start_server(endless, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    upstream = client(read_timeout_s=3.0)
    try:
        response = await upstream.request(make_target(url + CHAT), b"", b"{}")
        with pytest.raises(ProtocolError):
            await response.read()
        assert len(response.raw_headers) < 100
    finally:
        await upstream.close()
        server.close()
    assert sent["bytes"] < 16 << 20


async def test_a_stream_of_many_small_chunks_is_read_whole():
    """The framing bound leaves real streams alone: 5,000 one-event chunks (a few bytes of framing
    each, events of ~60 bytes) and a short trailer arrive whole."""
    event = b'data: {"choices":[{"delta":{"content":"tok"}}]}\n\n'
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(event), event) for _ in range(5000))
    answer = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        + chunked
        + b"0\r\nx-trailer: fine\r\n\r\n"
    )
    async with Server(lambda data: [(0, answer)]) as url:
        upstream = client(read_timeout_s=2.0)
        response = await upstream.request(make_target(url + CHAT), b"", b"{}")
        assert await response.read() == event * 5000
        await upstream.close()
