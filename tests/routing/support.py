"""Test helpers for the gateway: a vLLM-like stub node, an in-process gateway (snapshots: simulator.snapshots).

The stub node speaks vLLM's OpenAI API (SSE chunks as in /work/shared/fixtures/vllm_chat_stream.txt)
and is steered per request through an extra ``stub`` object in the body, which the gateway forwards
unchanged: ``{"stub": {"chunks": 5, "chunk_delay_s": 0.05, "delay_s": 0, "status": 200, "eof_delay_s": 0}}``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import redis.asyncio as aioredis

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
from routing.http.server import GatewayServer, listening_socket
from routing.writer import write_async
from simulator.snapshots import MODEL, REGIONS, make_node, make_snapshot  # noqa: F401  (the tests' one factory)
from tests.support.vllm_stub import SeenRequest, StubNode, stub_nodes  # noqa: F401  (the tests' one stub node)
from tests.support.waiting import wait_for  # noqa: F401  (re-exported for the routing tests)


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
    """Serve a ``Gateway`` with its own server (as ``python -m routing`` does) on a free port, in this loop."""
    app = Gateway(config, **app_kwargs)
    server = GatewayServer(app, config)
    await server.start(listening_socket("127.0.0.1", 0, reuse_port=False))
    http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=30)
    try:
        yield RunningGateway(app, server.port, http)
    finally:
        await http.aclose()
        await asyncio.wait_for(server.stop(), 10)


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
