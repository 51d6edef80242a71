"""Pipelined requests on one client connection: what the server holds for a client that sends
requests ahead of its answers, on an in-process client side over 127.0.0.1.

A pipelining client is answered in order, and the server reads ahead of the answer under way by
at most one read: a client that sends requests without end (or without reading its answers)
must not grow the gateway's memory with parsed requests or buffered answers.
"""

from __future__ import annotations

import asyncio
import socket

from routing.config import GatewayConfig
from routing.http.client_side import ClientConnection, ClientRequest
from tests.routing.support import wait_for
from tests.routing.test_connection_task import HEAD, Server, read_answers


class TunedServer(Server):
    """The recording server of test_connection_task with its own client-side settings."""

    def __init__(self, pad_bytes: int = 0, first_takes_s: float = 0.0, **settings: float) -> None:
        super().__init__()
        self.settings = settings
        self.pad = b" " * pad_bytes  # added to each answer's body
        self.first_takes_s = first_takes_s  # how long the first answer takes (a long stream)

    async def handle(self, request: ClientRequest) -> None:
        self.tasks.append(None)
        count = len(self.tasks)
        if count == 1 and self.first_takes_s:
            await asyncio.sleep(self.first_takes_s)
        received = await request.body(None, 1 << 20)
        answer = b"ok %d %d" % (count, len(received))
        request.respond(200, [(b"content-type", b"text/plain")], answer + self.pad)

    async def start(self) -> int:
        config = GatewayConfig(region="us-east", gateway_id="gw", **self.settings)

        def factory() -> ClientConnection:
            connection = ClientConnection(self.handle, config, self.stats)
            self.connections.append(connection)
            return connection

        self.server = await asyncio.get_running_loop().create_server(factory, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]


def unread_socket(port: int) -> socket.socket:
    """A non-blocking client connection with a small receive buffer, which will read nothing."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.setblocking(False)
    return sock


async def send_for(sock: socket.socket, data: bytes, seconds: float, *, once: bool = False) -> int:
    """Send ``data`` over and over (whole requests only; only once with ``once``) for at most
    ``seconds``; the bytes sent."""
    loop = asyncio.get_running_loop()
    sent = 0
    deadline = loop.time() + seconds
    while loop.time() < deadline and not (once and sent == len(data)):
        try:
            sent += sock.send(data[sent % len(data) :])
        except BlockingIOError:
            await asyncio.sleep(0.01)
        except OSError:
            break  # the server cut the connection
        else:
            await asyncio.sleep(0)
    return sent


async def test_a_client_that_pipelines_without_reading_holds_one_read_of_requests() -> None:
    """Before: each answer resumed reading, so every answer let in another read (~9,000 of these
    requests): after 5 s, 700,000 parsed requests waited in the connection's queue."""
    server = TunedServer(client_send_timeout_s=30.0)
    port = await server.start()
    sock = unread_socket(port)
    try:
        sent = await send_for(sock, HEAD * 10_000, 2.0)
        (connection,) = server.connections
        assert sent > 2_000_000  # far more than one read: the client kept sending
        # One read of requests at most (256 KiB of 29-byte requests), and the answers the
        # client's buffers would not take up to the transport's high-water mark and one more.
        assert len(connection._pipeline) < 10_000, len(connection._pipeline)
        assert connection.transport.get_write_buffer_size() < 1 << 20
    finally:
        sock.close()
        await server.stop()


async def test_held_requests_are_answered_in_order_once_the_client_reads() -> None:
    server = TunedServer(pad_bytes=65_536, client_send_timeout_s=30.0)
    port = await server.start()
    sock = unread_socket(port)
    count = 300  # ~20 MB of answers: more than the socket buffers take unread
    try:
        assert await send_for(sock, HEAD * count, 5.0, once=True) == len(HEAD) * count
        await wait_for(
            lambda: server.connections and server.connections[0]._held,
            what="the answers wait for the client",
        )
        assert len(server.tasks) < count
        sock.setblocking(True)
        reader, writer = await asyncio.open_connection(sock=sock)
        answers = await read_answers(reader, count)
        assert [answer.rstrip() for answer in answers[:: count - 1]] == [
            b"HTTP/1.1 200 OK ok 1 0",
            b"HTTP/1.1 200 OK ok %d 0" % count,
        ]
        writer.close()
    finally:
        sock.close()
        await server.stop()


async def test_a_client_that_never_reads_its_answers_is_cut_at_the_send_timeout() -> None:
    server = TunedServer(client_send_timeout_s=0.5)
    port = await server.start()
    sock = unread_socket(port)
    try:
        await send_for(sock, HEAD * 10_000, 0.5)
        (connection,) = server.connections
        await wait_for(lambda: connection.transport.is_closing(), timeout_s=5)
        assert server.stats.send_timeouts == 1
    finally:
        sock.close()
        await server.stop()


POST_HEAD = b"POST /x HTTP/1.1\r\nHost: gw\r\nContent-Length: %d\r\n\r\n"


async def test_a_pipelined_body_held_back_by_the_server_gets_its_deadline_when_its_turn_comes() -> None:
    """Before: the body deadline of a pipelined request ran while the server read nothing of it
    (reading pauses while it waits its turn), so a long first answer (a stream) was cut when the
    second request's body had not come: the server's own pause counted against the client."""
    server = TunedServer(first_takes_s=1.0, client_body_timeout_s=0.3)
    port = await server.start()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        payload = b"x" * 200_000
        writer.write(HEAD + POST_HEAD % len(payload) + payload[:10])
        await asyncio.sleep(0.1)  # the server has read the second head: it holds the rest unread
        writer.write(payload[10:])
        answers = await read_answers(reader, 2)
        assert answers == [b"HTTP/1.1 200 OK ok 1 0", b"HTTP/1.1 200 OK ok 2 %d" % len(payload)]
        assert server.stats.body_timeouts == 0
    finally:
        writer.close()
        await server.stop()


async def test_a_pipelined_head_held_back_by_the_server_gets_its_deadline_when_its_turn_comes() -> None:
    """The same for a third request's head, begun in the read that held the second request."""
    server = TunedServer(first_takes_s=1.0, client_header_timeout_s=0.3)
    port = await server.start()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(HEAD + HEAD + HEAD[:10])
        await asyncio.sleep(0.1)
        writer.write(HEAD[10:])
        answers = await read_answers(reader, 3)
        assert answers == [b"HTTP/1.1 200 OK ok %d 0" % count for count in (1, 2, 3)]
        assert server.stats.header_timeouts == 0
    finally:
        writer.close()
        await server.stop()
