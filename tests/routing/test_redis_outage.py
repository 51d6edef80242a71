"""Redis going away: the gateway keeps serving its last good policy and reconnects by itself.

Uses a private ``redis-server`` on a free port (never the shared one, which other runs use).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest
import redis.asyncio as aioredis

from routing.contract import RedisKeys, RequestRecord, decode
from simulator.harness import free_port
from tests.routing.support import (
    MODEL,
    gateway_config,
    make_node,
    make_snapshot,
    publish,
    running_gateway,
    wait_for,
)

pytestmark = pytest.mark.e2e  # starts redis-server processes

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
KEYS = RedisKeys(prefix="gorgo")  # the private server is ours alone


class PrivateRedis:
    """A throw-away redis-server that a test may stop and start again on the same port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while (
            subprocess.run(["redis-cli", "-p", str(self.port), "ping"], capture_output=True).stdout
            != b"PONG\n"
        ):
            assert time.monotonic() < deadline, "private redis-server did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)
            self.process = None


@pytest.fixture
def private_redis() -> Iterator[PrivateRedis]:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server is not installed")
    server = PrivateRedis()
    server.start()
    yield server
    server.stop()


async def publish_to(url: str, snapshot) -> None:
    client = aioredis.Redis.from_url(url)
    await publish(client, KEYS, snapshot)
    await client.aclose()


class TestRedisOutage:
    async def test_it_serves_through_an_outage_and_picks_up_policy_after_it(self, private_redis, stubs):
        await publish_to(
            private_redis.url, make_snapshot((make_node(1, stubs[0].url, name="gpu-a"),), version=1)
        )
        config = gateway_config(KEYS, private_redis.url)
        async with running_gateway(config) as gateway, httpx.AsyncClient() as client:
            store = gateway.app.runtime.store
            assert (await client.post(f"{gateway.url}/v1/chat/completions", json=BODY)).status_code == 200

            private_redis.stop()
            await wait_for(lambda: not store.redis_connected)
            during = [await client.post(f"{gateway.url}/v1/chat/completions", json=BODY) for _ in range(5)]
            health = await client.get(f"{gateway.url}/healthz")
            assert [answer.status_code for answer in during] == [200] * 5
            assert health.status_code == 200 and health.json()["redis_connected"] is False

            private_redis.start()
            await wait_for(lambda: store.redis_connected, timeout_s=15)
            replacement = (make_node(2, stubs[1].url, name="gpu-b"),)
            await publish_to(private_redis.url, make_snapshot(replacement, version=2))
            await wait_for(lambda: store.table.version == 2)
            after = await client.post(f"{gateway.url}/v1/chat/completions", json=BODY)
            assert after.headers["x-gorgo-node"] == "gpu-b"

            # records of the requests served during the outage were kept and written afterwards
            reader = aioredis.Redis.from_url(private_redis.url)
            await wait_for(lambda: gateway.app.runtime.request_log.pending == 0, timeout_s=15)
            records = [decode(f[b"r"], RequestRecord) for _, f in await reader.xrange(KEYS.request_stream)]
            await reader.aclose()
        assert sum(1 for record in records if record.status == 200 and record.policy_version == 1) >= 5

    async def test_it_starts_without_redis_and_loads_the_policy_once_redis_is_back(
        self, private_redis, stubs
    ):
        private_redis.stop()
        config = gateway_config(KEYS, private_redis.url)
        async with running_gateway(config) as gateway, httpx.AsyncClient() as client:
            assert (await client.get(f"{gateway.url}/healthz")).status_code == 503
            private_redis.start()
            await publish_to(private_redis.url, make_snapshot((make_node(1, stubs[0].url),), version=3))
            await wait_for(lambda: gateway.app.runtime.store.table is not None, timeout_s=15)
            assert (await client.get(f"{gateway.url}/healthz")).json()["policy_version"] == 3
            assert (await client.post(f"{gateway.url}/v1/chat/completions", json=BODY)).status_code == 200
