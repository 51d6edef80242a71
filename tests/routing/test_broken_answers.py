"""A node that breaks off its answer: 502 before the first byte, an SSE error event after it."""

from __future__ import annotations

import asyncio
import json

import pytest

from routing.contract import RequestRecord, decode
from tests.conftest import free_port
from tests.routing.support import (
    MODEL,
    gateway_config,
    make_node,
    make_snapshot,
    publish,
    running_gateway,
    wait_for,
)

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
EVENT = b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"tok"}}]}\n\n'


class BreakingNode(asyncio.Protocol):
    """Answers with a head and part of a body, then closes the connection."""

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        if b'"stream":true' in data.replace(b" ", b""):
            chunk = b"%x\r\n%s\r\n" % (len(EVENT), EVENT)
            self.transport.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                + chunk * 2
            )
        else:
            self.transport.write(
                b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{"id": '
            )
        asyncio.get_running_loop().call_later(0.05, self.transport.close)


async def breaking_node_url() -> tuple[asyncio.Server, str]:
    server = await asyncio.get_running_loop().create_server(BreakingNode, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


class TestBrokenAnswers:
    async def test_it_answers_502_for_a_body_cut_short(self, aredis, redis_keys, redis_url):
        server, url = await breaking_node_url()
        await publish(aredis, redis_keys, make_snapshot((make_node(1, url, name="flaky"),)))
        try:
            async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
                response = await gateway.http.post("/v1/chat/completions", json=BODY)
        finally:
            server.close()
        assert response.status_code == 502
        error = response.json()["error"]
        assert error["type"] == "BadGatewayError" and "flaky" in error["message"]

    async def test_it_ends_a_broken_stream_with_an_error_event(self, aredis, redis_keys, redis_url):
        server, url = await breaking_node_url()
        await publish(aredis, redis_keys, make_snapshot((make_node(1, url, name="flaky"),)))
        try:
            async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
                response = await gateway.http.post("/v1/chat/completions", json={**BODY, "stream": True})
                await wait_for(lambda: aredis.xlen(redis_keys.request_stream))
        finally:
            server.close()
        assert response.status_code == 200  # already sent when the node broke off
        events = [line for line in response.text.splitlines() if line.startswith("data:")]
        assert events[:2] == [EVENT.decode().strip()] * 2
        assert json.loads(events[-1].removeprefix("data: "))["error"]["type"] == "BadGatewayError"
        (entry,) = await aredis.xrange(redis_keys.request_stream)
        record = decode(entry[1][b"r"], RequestRecord)
        assert record.status == 502 and "flaky" in (record.error or "")


class MidEventNode(asyncio.Protocol):
    """Streams one whole event and the start of another (``cut`` bytes of it), then closes."""

    cut = 20

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        body = EVENT + EVENT[: MidEventNode.cut]
        self.transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            + b"%x\r\n%s\r\n" % (len(body), body)
        )
        asyncio.get_running_loop().call_later(0.05, self.transport.close)


def sse_events(text: str) -> list[str]:
    """The data of each event as an SSE client dispatches it (events end at a blank line)."""
    events, data = [], []
    for line in text.split("\n"):
        if not line:
            if data:
                events.append("\n".join(data))
            data = []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    return events


class TestBreakInsideAnEvent:
    @pytest.mark.parametrize("cut", [20, len(EVENT) - 1])  # inside the data line; before the blank line
    async def test_the_error_event_is_an_event_of_its_own(self, aredis, redis_keys, redis_url, cut):
        """A node that dies inside an event: the gateway's error event was appended to the partial
        line (or event), so the client's SSE parser read one broken event and never saw the error."""
        MidEventNode.cut = cut
        server = await asyncio.get_running_loop().create_server(MidEventNode, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        await publish(aredis, redis_keys, make_snapshot((make_node(1, url, name="flaky"),)))
        try:
            async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
                response = await gateway.http.post("/v1/chat/completions", json={**BODY, "stream": True})
        finally:
            server.close()
        events = sse_events(response.text)
        assert events[0] == EVENT.decode().strip().removeprefix("data: ")
        assert json.loads(events[-1])["error"]["type"] == "BadGatewayError"


# What vLLM sends when a request fails after its stream started (chat_completion_stream_generator:
# a GenerationError, finish_reason "error"): the error event, then [DONE].
VLLM_ERROR = (
    b'data: {"error": {"message": "Internal server error", "type": "InternalServerError", '
    b'"param": null, "code": 500}}\n\n'
)


class ErrorEventNode(asyncio.Protocol):
    """Streams a token, then vLLM's mid-stream error event and [DONE], and ends the body."""

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        body = EVENT + VLLM_ERROR + b"data: [DONE]\n\n"
        self.transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        )


class TestNodeErrorEvent:
    async def test_the_record_keeps_the_error_a_node_ended_its_stream_with(
        self, aredis, redis_keys, redis_url
    ):
        """vLLM says a failure after its 200 in the stream; the record said 200 and no error."""
        server = await asyncio.get_running_loop().create_server(ErrorEventNode, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        await publish(aredis, redis_keys, make_snapshot((make_node(1, url, name="flaky"),)))
        try:
            async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
                response = await gateway.http.post("/v1/chat/completions", json={**BODY, "stream": True})
                await wait_for(lambda: aredis.xlen(redis_keys.request_stream))
        finally:
            server.close()
        assert response.status_code == 200
        assert response.content == EVENT + VLLM_ERROR + b"data: [DONE]\n\n"  # passed on unchanged
        (entry,) = await aredis.xrange(redis_keys.request_stream)
        record = decode(entry[1][b"r"], RequestRecord)
        assert record.status == 500
        assert "flaky" in (record.error or "") and "Internal server error" in (record.error or "")


class HeadThenDiesNode(asyncio.Protocol):
    """Sends a stream's head at once (as vLLM does), then dies while "prefilling": no event ever."""

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        self.transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        asyncio.get_running_loop().call_later(0.05, self.transport.close)


class StreamingNode(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        body = EVENT + b"data: [DONE]\n\n"
        self.transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        )


async def serve(protocol) -> tuple[asyncio.Server, str]:
    server = await asyncio.get_running_loop().create_server(protocol, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def _count_is(count, expected: int) -> bool:
    return await count == expected


class TestDeathBeforeTheFirstEvent:
    """A node that dies after its stream's head and before its first event (an outage takes a
    node while requests queue or prefill there) had its 200 passed on: the client got a stream
    holding only the gateway's error event, where another node could have answered."""

    async def test_the_request_is_answered_by_another_node(self, aredis, redis_keys, redis_url):
        dying, dying_url = await serve(HeadThenDiesNode)
        good, good_url = await serve(StreamingNode)
        nodes = (make_node(1, dying_url, name="dying"), make_node(2, good_url, name="good"))
        await publish(aredis, redis_keys, make_snapshot(nodes))
        try:
            async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
                answers = [
                    await gateway.http.post("/v1/chat/completions", json={**BODY, "stream": True})
                    for _ in range(4)  # round robin: the dying node is chosen first at least once
                ]
                await wait_for(lambda: _count_is(aredis.xlen(redis_keys.request_stream), 4))
        finally:
            dying.close()
            good.close()
        for answer in answers:
            assert answer.status_code == 200
            assert answer.content == EVENT + b"data: [DONE]\n\n"
            assert answer.headers["x-gorgo-node"] == "good"
        records = [
            decode(entry[1][b"r"], RequestRecord) for entry in await aredis.xrange(redis_keys.request_stream)
        ]
        assert {record.status for record in records} == {200}
        assert {record.node_id for record in records} == {2}

    async def test_with_no_other_node_the_client_gets_an_error_status(self, aredis, redis_keys, redis_url):
        dying, dying_url = await serve(HeadThenDiesNode)
        await publish(aredis, redis_keys, make_snapshot((make_node(1, dying_url, name="dying"),)))
        try:
            async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
                response = await gateway.http.post("/v1/chat/completions", json={**BODY, "stream": True})
        finally:
            dying.close()
        assert response.status_code == 502  # an error status, not a 200 holding an error event
        error = response.json()["error"]
        assert error["type"] == "BadGatewayError" and "dying" in error["message"]


class TestRefusedConnections:
    """A region going down: its nodes all refuse connections at once. With one retry allowed, a
    request whose first node and retry were both there failed (502) while another node was fine."""

    async def test_every_refusing_node_is_passed_over_for_one_that_answers(
        self, aredis, redis_keys, redis_url
    ):
        good, good_url = await serve(StreamingNode)
        dead = [f"http://127.0.0.1:{free_port()}" for _ in range(3)]
        # Round robin over the id order: the first try and the retry both land on refusing nodes.
        nodes = (
            make_node(1, good_url, name="good"),
            *(make_node(i + 2, url, name=f"dead-{i + 1}") for i, url in enumerate(dead)),
        )
        await publish(aredis, redis_keys, make_snapshot(nodes))
        try:
            config = gateway_config(redis_keys, redis_url, upstream_retries=1, retry_budget_ratio=10.0)
            async with running_gateway(config) as gateway:
                answer = await gateway.http.post("/v1/chat/completions", json={**BODY, "stream": True})
        finally:
            good.close()
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-gorgo-node"] == "good"

    async def test_with_every_node_refusing_each_is_tried_once(self, aredis, redis_keys, redis_url):
        dead = [f"http://127.0.0.1:{free_port()}" for _ in range(4)]
        nodes = tuple(make_node(i + 1, url, name=f"dead-{i + 1}") for i, url in enumerate(dead))
        await publish(aredis, redis_keys, make_snapshot(nodes))
        config = gateway_config(redis_keys, redis_url, upstream_retries=1, retry_budget_ratio=10.0)
        async with running_gateway(config) as gateway:
            answer = await gateway.http.post("/v1/chat/completions", json={**BODY, "stream": True})
            retries = (await gateway.http.get("/metrics")).text
        assert answer.status_code == 502 and "unreachable" in answer.json()["error"]["message"]
        tried = [line for line in retries.splitlines() if line.startswith("gorgo_gateway_retries_total")]
        assert sum(float(line.rsplit(" ", 1)[1]) for line in tried) == 3, tried  # four nodes, once each


class HeadThenHangsNode(asyncio.Protocol):
    """Sends a stream's head, then nothing ever: no event, no close, and no answer to /health."""

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        if data.startswith(b"POST "):
            self.transport.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            )


class TestHangBeforeTheFirstEvent:
    async def test_the_stream_is_taken_back_after_a_failed_health_probe(self, aredis, redis_keys, redis_url):
        """Before: the request waited for the node's first event until the read timeout (minutes),
        though nothing had gone to the client and another node was idle."""
        hanging, hanging_url = await serve(HeadThenHangsNode)
        good, good_url = await serve(StreamingNode)
        nodes = (make_node(1, good_url, name="good"), make_node(2, hanging_url, name="hanging"))
        await publish(aredis, redis_keys, make_snapshot(nodes))
        try:
            config = gateway_config(redis_keys, redis_url, upstream_first_byte_timeout_s=0.5)
            async with running_gateway(config) as gateway:
                answers = [
                    await asyncio.wait_for(
                        gateway.http.post("/v1/chat/completions", json={**BODY, "stream": True}), 20
                    )
                    for _ in range(2)  # round robin: one of them goes to the hanging node first
                ]
                metrics = (await gateway.http.get("/metrics")).text
        finally:
            hanging.close()
            good.close()
        for answer in answers:
            assert answer.status_code == 200 and answer.headers["x-gorgo-node"] == "good"
            assert answer.content == EVENT + b"data: [DONE]\n\n"
        assert 'gorgo_gateway_retries_total{reason="first_byte"} 1.0' in metrics
