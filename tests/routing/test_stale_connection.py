"""A node that drops a reused keep-alive connection is retried once, even as the only candidate."""

from __future__ import annotations

import asyncio
import json

from tests.routing.support import MODEL, gateway_config, make_node, make_snapshot, publish, running_gateway

ANSWER = json.dumps({"id": "x", "object": "chat.completion", "choices": [], "usage": None}).encode()


class DroppingNode(asyncio.Protocol):
    """A node that answers every request except those numbered in ``drop``: on those it closes the
    connection without a word, as a server does when its keep-alive timer fires just as a request
    arrives."""

    served = 0
    dropped = 0
    drop = {2}

    def connection_made(self, transport):
        self.transport = transport
        self.buffer = b""

    def data_received(self, data):
        self.buffer += data
        while b"\r\n\r\n" in self.buffer:
            head, rest = self.buffer.split(b"\r\n\r\n", 1)
            length = int(
                next(
                    line.split(b":")[1]
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
            )
            if len(rest) < length:
                return
            self.buffer = rest[length:]
            number = DroppingNode.served + DroppingNode.dropped + 1
            if number in DroppingNode.drop:
                DroppingNode.dropped += 1
                self.transport.close()
                return
            DroppingNode.served += 1
            self.transport.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (len(ANSWER), ANSWER)
            )


class TestStaleConnection:
    async def test_it_retries_the_only_node_once_on_a_fresh_connection(self, aredis, redis_keys, redis_url):
        server = await asyncio.get_running_loop().create_server(DroppingNode, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        await publish(aredis, redis_keys, make_snapshot((make_node(1, url, name="only"),)))
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        try:
            async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
                answers = [await gateway.http.post("/v1/chat/completions", json=body) for _ in range(3)]
        finally:
            server.close()
        assert [answer.status_code for answer in answers] == [200, 200, 200]
        assert (DroppingNode.served, DroppingNode.dropped) == (3, 1)
