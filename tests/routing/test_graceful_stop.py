"""A gateway told to stop lets the answers under way finish, for at most GORGO_SHUTDOWN_GRACE_S."""

from __future__ import annotations

import asyncio

import httpx

from routing.app import Gateway
from routing.contract import RequestRecord, decode
from routing.http.server import GatewayServer, listening_socket
from tests.routing.support import MODEL, gateway_config, make_node, make_snapshot, publish, wait_for

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}


async def started(config) -> GatewayServer:
    server = GatewayServer(Gateway(config), config)
    await server.start(listening_socket("127.0.0.1", 0, reuse_port=False))
    return server


async def stream_while_stopping(server: GatewayServer, request: dict) -> tuple[list[str], str | None]:
    """Start a stream, stop the server after its first event; the lines read and how it ended."""
    lines: list[str] = []
    ended = None
    stop: asyncio.Task[None] | None = None
    async with httpx.AsyncClient(timeout=20) as client:
        try:
            url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
            async with client.stream("POST", url, json=request) as response:
                async for line in response.aiter_lines():
                    lines.append(line)
                    if stop is None and line.startswith("data:"):
                        stop = asyncio.create_task(server.stop())
        except httpx.HTTPError as exc:
            ended = type(exc).__name__
    assert stop is not None
    await asyncio.wait_for(stop, 20)
    return lines, ended


async def records(aredis, keys) -> list[RequestRecord]:
    return [decode(fields[b"r"], RequestRecord) for _, fields in await aredis.xrange(keys.request_stream)]


async def test_it_finishes_a_stream_under_way_and_then_stops(aredis, redis_keys, redis_url, stubs):
    await publish(aredis, redis_keys, make_snapshot((make_node(1, stubs[0].url),)))
    server = await started(gateway_config(redis_keys, redis_url, shutdown_grace_s=20.0))
    request = {**BODY, "stub": {"chunks": 10, "chunk_delay_s": 0.02}}

    lines, ended = await stream_while_stopping(server, request)

    assert ended is None and "data: [DONE]" in lines
    assert server.gateway.runtime is None  # shut down after the stream
    (record,) = await records(aredis, redis_keys)  # the log was flushed after the request ended
    assert record.status == 200


async def test_a_stream_past_the_grace_period_is_cut_and_cancelled(aredis, redis_keys, redis_url, stubs):
    await publish(aredis, redis_keys, make_snapshot((make_node(1, stubs[0].url),)))
    server = await started(gateway_config(redis_keys, redis_url, shutdown_grace_s=0.2))
    request = {**BODY, "stub": {"chunks": 1000, "chunk_delay_s": 0.05}}

    lines, ended = await stream_while_stopping(server, request)

    assert ended is not None and "data: [DONE]" not in lines
    await wait_for(lambda: stubs[0].aborted == 1, timeout_s=10)  # the node's request was cancelled
    (record,) = await records(aredis, redis_keys)
    assert record.status == 499
