"""Test helpers for the gateway: a vLLM-like stub node, an in-process gateway (snapshots: simulator.snapshots).

The stub node speaks vLLM's OpenAI API (SSE chunks as in /work/shared/fixtures/vllm_chat_stream.txt)
and is steered per request through an extra ``stub`` object in the body, which the gateway forwards
unchanged: ``{"stub": {"chunks": 5, "chunk_delay_s": 0.05, "delay_s": 0, "status": 200, "eof_delay_s": 0}}``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import redis.asyncio as aioredis
import uvicorn
from aiohttp import web
from multidict import CIMultiDict

from routing.app import Gateway
from routing.config import GatewayConfig
from routing.contract import (
    SCHEMA_VERSION,
    ClientKeySet,
    ClientKeySpec,
    NodeLiveState,
    PolicySnapshot,
    RedisKeys,
    RTTEntry,
    RTTTable,
    encode,
)
from routing.frontdoor.keystore import secret_hash
from routing.writer import write_async
from simulator.snapshots import MODEL, REGIONS, make_node, make_snapshot  # noqa: F401  (the tests' one factory)


async def publish(client: aioredis.Redis, keys: RedisKeys, snapshot: PolicySnapshot) -> None:
    """What the control plane does: compare-and-set the snapshot, then announce it."""
    assert await write_async(client, keys, snapshot), "Redis holds a newer snapshot"


async def publish_live(
    client: aioredis.Redis,
    keys: RedisKeys,
    *,
    healthy: dict[int, bool] | None = None,
    rtt_ms: dict[tuple[str, int], float] | None = None,
) -> None:
    """What the telemetry workers do: write live node state / the RTT table, then notify."""
    now = time.time()
    if healthy:
        await client.hset(
            keys.live_nodes,
            mapping={
                str(node_id): encode(NodeLiveState(SCHEMA_VERSION, node_id, ok, now))
                for node_id, ok in healthy.items()
            },
        )
        await client.publish(keys.live_channel, keys.live_nodes)
    if rtt_ms:
        entries = tuple(
            RTTEntry(region=region, node_id=node_id, rtt_ms=rtt, jitter_ms=0.1, samples=5, updated_at=now)
            for (region, node_id), rtt in rtt_ms.items()
        )
        await client.set(keys.live_rtt, encode(RTTTable(SCHEMA_VERSION, now, entries)))
        await client.publish(keys.live_channel, keys.live_rtt)


async def wait_for(predicate: Any, timeout_s: float = 5.0, interval_s: float = 0.02) -> None:
    """Poll ``predicate`` (sync or async) until true; fail after ``timeout_s`` (an upper bound only)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s")
        await asyncio.sleep(interval_s)


# ---- the stub node ---------------------------------------------------------------------------


@dataclass
class SeenRequest:
    path: str
    headers: CIMultiDict[str]
    body: dict[str, Any]


@dataclass
class StubNode:
    """A tiny vLLM look-alike on 127.0.0.1:<free port>."""

    name: str
    seen: list[SeenRequest] = field(default_factory=list)
    aborted: int = 0  # requests the client (the gateway) hung up on
    events_written: int = 0  # SSE content events written so far, over all streams
    streams_finished: int = 0
    runner: web.AppRunner | None = None
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_post("/v1/completions", self._handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(SeenRequest(request.path, CIMultiDict(request.headers), body))
        stub = body.get("stub", {})
        if stub.get("delay_s"):
            await asyncio.sleep(stub["delay_s"])
            if request.transport is None or request.transport.is_closing():
                self.aborted += 1  # the gateway hung up while we "generated"
                return web.Response(status=499)
        status = stub.get("status", 200)
        if status != 200:
            error = {"message": "stub error", "type": "BadRequestError", "param": None, "code": status}
            return web.json_response({"error": error}, status=status)
        chat = request.path == "/v1/chat/completions"
        words = [f" w{i}" for i in range(stub.get("chunks", 3))]
        usage = {
            "prompt_tokens": 42,
            "total_tokens": 42 + len(words),
            "completion_tokens": len(words),
            "prompt_tokens_details": {"cached_tokens": 32},
        }
        if not body.get("stream"):
            text = "".join(words)
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                if chat
                else {"index": 0, "text": text, "finish_reason": "stop"}
            )
            return web.json_response(
                {
                    "id": "cmpl-stub",
                    "object": "chat.completion" if chat else "text_completion",
                    "created": 1767225600,
                    "model": body["model"],
                    "choices": [choice],
                    "usage": usage,
                    "served_by": self.name,
                },
                headers={"X-Stub-Node": self.name},
            )
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Stub-Node": self.name})
        await response.prepare(request)
        try:
            for index, word in enumerate(words):
                delta = {"role": "assistant", "content": word} if index == 0 else {"content": word}
                choice = {"index": 0, "delta": delta} if chat else {"index": 0, "text": word}
                chunk = {"id": "cmpl-stub", "object": "chat.completion.chunk", "model": body["model"]}
                await response.write(
                    b"data: " + json.dumps({**chunk, "choices": [choice]}).encode() + b"\n\n"
                )
                self.events_written += 1
                if stub.get("chunk_delay_s"):
                    await asyncio.sleep(stub["chunk_delay_s"])
            if (body.get("stream_options") or {}).get("include_usage"):
                chunk = {"id": "cmpl-stub", "choices": [], "usage": usage}
                await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            if stub.get("eof_delay_s"):
                # The end of the body arrives after [DONE] (a slow last TCP segment).
                await asyncio.sleep(stub["eof_delay_s"])
            await response.write_eof()
            self.streams_finished += 1
        except (ConnectionResetError, asyncio.CancelledError):
            self.aborted += 1
            raise
        return response


@asynccontextmanager
async def stub_nodes(*names: str) -> AsyncIterator[list[StubNode]]:
    nodes = [StubNode(name) for name in names]
    for node in nodes:
        await node.start()
    try:
        yield nodes
    finally:
        for node in nodes:
            await node.stop()


# ---- an in-process gateway -------------------------------------------------------------------


@dataclass
class RunningGateway:
    app: Gateway
    port: int
    http: httpx.AsyncClient  # a client for this gateway (relative URLs work)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def gateway_config(
    keys: RedisKeys, redis_url: str, *, region: str = "us-east", **overrides: Any
) -> GatewayConfig:
    settings: dict[str, Any] = {
        "region": region,
        "gateway_id": f"test-gw-{region}",
        "redis_url": redis_url,
        "redis_prefix": keys.prefix,
        "port": 0,
        "request_log_flush_interval_s": 0.01,
        "live_refresh_interval_s": 0.2,
        "auth": "off",  # these tests are about routing; tests/routing/test_auth*.py turn it on
        **overrides,
    }
    return GatewayConfig(**settings)


@asynccontextmanager
async def running_gateway(config: GatewayConfig, **app_kwargs: Any) -> AsyncIterator[RunningGateway]:
    """Serve a ``Gateway`` with uvicorn (httptools, like production) on a free port, in this loop."""
    app = Gateway(config, **app_kwargs)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=0,
            http="httptools",
            lifespan="on",
            log_level="warning",
            access_log=False,
        )
    )
    task = asyncio.create_task(server.serve())
    await wait_for(lambda: server.started or task.done(), timeout_s=10)
    if task.done():
        task.result()
        raise RuntimeError("gateway did not start")
    port = server.servers[0].sockets[0].getsockname()[1]
    http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30)
    try:
        yield RunningGateway(app, port, http)
    finally:
        await http.aclose()
        server.should_exit = True
        await asyncio.wait_for(task, 10)


# ---- client keys -------------------------------------------------------------------------------


def make_key(secret: str, key_id: str = "k1", **fields: Any) -> ClientKeySpec:
    """A key set entry for ``secret`` (what the control plane writes, hash only)."""
    return ClientKeySpec(id=key_id, secret_sha256=secret_hash(secret), owner="tests", **fields)


async def publish_keys(client: aioredis.Redis, keys: RedisKeys, *specs: ClientKeySpec) -> None:
    """What the control plane does on a key change: write the whole set, announce it."""
    key_set = ClientKeySet(
        schema_version=SCHEMA_VERSION, version=time.time_ns() // 1000, written_at=time.time(), keys=specs
    )
    await write_async(client, keys, key_set)
