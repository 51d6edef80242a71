"""A client connection runs its requests' handlers on one task, one request after the other.

A task per request cost ~9 k instructions of ~300 k (Python 3.11 keeps every task in a
``WeakSet``, in Python code); these pin down what the connection's task keeps of a task per
request: a request's cancellation is its own, a pipelined request is served in order, a graceful
stop sees the task only while a request is under way, and the task ends with its connection.
"""

from __future__ import annotations

import asyncio

from routing.config import GatewayConfig
from routing.http.client_side import ClientConnection, ClientRequest, ClientStats

HEAD = b"GET /x HTTP/1.1\r\nHost: gw\r\n\r\n"


class Server:
    """A client-side server on 127.0.0.1 whose handler records which task ran each request."""

    def __init__(self) -> None:
        self.stats = ClientStats()
        self.tasks: list[asyncio.Task[object] | None] = []
        self.in_requests: list[bool] = []
        self.cancel_first = False
        self.server: asyncio.Server | None = None
        self.connections: list[ClientConnection] = []

    async def handle(self, request: ClientRequest) -> None:
        task = asyncio.current_task()
        self.tasks.append(task)
        self.in_requests.append(task in self.stats.requests)
        if self.cancel_first and len(self.tasks) == 1:
            assert task is not None
            task.cancel()  # pending: delivered at the next await, which this request never makes
        else:
            await asyncio.sleep(0)
        request.respond(200, [(b"content-type", b"text/plain")], b"ok %d" % len(self.tasks))

    async def start(self) -> int:
        config = GatewayConfig(region="us-east", gateway_id="gw")

        def factory() -> ClientConnection:
            connection = ClientConnection(self.handle, config, self.stats)
            self.connections.append(connection)
            return connection

        self.server = await asyncio.get_running_loop().create_server(factory, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


async def read_answers(reader: asyncio.StreamReader, count: int) -> list[bytes]:
    answers = []
    for _ in range(count):
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        answers.append(head.split(b"\r\n")[0] + b" " + await reader.readexactly(length))
    return answers


async def test_kept_alive_requests_run_on_one_task_and_it_ends_with_the_connection() -> None:
    server = Server()
    port = await server.start()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        answers = []
        for _ in range(3):
            writer.write(HEAD)
            answers += await read_answers(reader, 1)
        assert answers == [b"HTTP/1.1 200 OK ok 1", b"HTTP/1.1 200 OK ok 2", b"HTTP/1.1 200 OK ok 3"]
        assert len(set(server.tasks)) == 1  # one task served all three
        assert server.in_requests == [True, True, True]  # a graceful stop waits for each
        task = server.tasks[0]
        assert task is not None and not task.done()
        assert not server.stats.requests  # idle between requests: nothing for a stop to wait on
    finally:
        writer.close()
        await writer.wait_closed()
    await asyncio.wait_for(task, 5)  # the client left: the connection's task ended
    assert server.connections[0]._task is None
    await server.stop()


async def test_pipelined_requests_are_answered_in_order_on_the_connections_task() -> None:
    server = Server()
    port = await server.start()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(HEAD * 3)
        answers = await read_answers(reader, 3)
        assert answers == [b"HTTP/1.1 200 OK ok 1", b"HTTP/1.1 200 OK ok 2", b"HTTP/1.1 200 OK ok 3"]
        assert len(set(server.tasks)) == 1
    finally:
        writer.close()
        await writer.wait_closed()
    await server.stop()


async def test_a_cancellation_left_pending_by_one_request_does_not_reach_the_next() -> None:
    server = Server()
    server.cancel_first = True
    port = await server.start()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for pipelined in (1, 2):
            writer.write(HEAD * pipelined)
            await read_answers(reader, pipelined)
        # The first request's task ended with the cancellation meant for it; the next requests
        # ran on a new task, uncancelled, and were answered.
        first, *rest = server.tasks
        assert first is not None and first.cancelled()
        assert len(rest) == 2 and len(set(rest)) == 1 and rest[0] is not first
        assert rest[0] is not None and not rest[0].cancelling()
    finally:
        writer.close()
        await writer.wait_closed()
    await server.stop()
