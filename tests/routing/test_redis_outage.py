"""Redis going away: the gateway keeps serving its last good policy and reconnects by itself.

Uses a private ``redis-server`` on a free port (never the shared one, which other runs use).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest
import redis.asyncio as aioredis

from routing.contract import RedisKeys, RequestRecord, decode
from routing.frontdoor.ratelimit import RateLimiter, make_limiter_redis
from simulator.harness import free_port
from tests.routing.support import (
    MODEL,
    gateway_config,
    make_key,
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


class TestHungRedis:
    """Issue 22, item 6: a SIGSTOPped Redis accepts connections and answers nothing. The policy
    listener's pubsub socket just stays quiet, so /healthz said ``redis_connected: true`` and the
    "gateway without Redis" alert never fired; the limiters warned every 1.25 s."""

    async def test_healthz_says_a_stopped_redis_is_not_connected_and_sees_it_come_back(
        self, private_redis, stubs
    ):
        await publish_to(private_redis.url, make_snapshot((make_node(1, stubs[0].url),), version=1))
        async with running_gateway(gateway_config(KEYS, private_redis.url)) as gateway:
            store = gateway.app.runtime.store
            await wait_for(lambda: store.redis_connected)
            os.kill(private_redis.process.pid, signal.SIGSTOP)
            try:
                # The live refresh (every 0.2 s here) is the ping; its socket timeout is 2 s.
                await wait_for(lambda: not store.redis_connected, timeout_s=10, what="hung Redis noticed")
                health = (await gateway.http.get("/healthz")).json()
                assert health["redis_connected"] is False
                served = await gateway.http.post("/v1/chat/completions", json=BODY)
                assert served.status_code == 200  # the last good policy still serves
            finally:
                os.kill(private_redis.process.pid, signal.SIGCONT)
            await wait_for(lambda: store.redis_connected, timeout_s=15, what="Redis back")
            assert (await gateway.http.get("/healthz")).json()["redis_connected"] is True

    async def test_the_rate_limiter_warns_once_per_outage_of_a_hung_redis(self, private_redis, caplog):
        now = [0.0]
        client = make_limiter_redis(private_redis.url, 0.25)
        limiter = RateLimiter(client, KEYS, retry_after_s=1.0, clock=lambda: now[0])
        key = make_key("gorgo-sk-k1-hung-redis", requests_per_min=600)
        caplog.set_level(logging.INFO, logger="routing.ratelimit")

        def warnings() -> int:
            return sum("Redis unreachable" in record.getMessage() for record in caplog.records)

        try:
            assert (await limiter.check(key, 1)).allowed  # Redis answers: no warning
            limiter._leases.clear()
            os.kill(private_redis.process.pid, signal.SIGSTOP)
            try:
                for step in range(4):  # each retry after the backoff times out again
                    now[0] = 10.0 + step * 1.2
                    limiter._leases.clear()
                    assert (await limiter.check(key, 1)).allowed  # answered locally
            finally:
                os.kill(private_redis.process.pid, signal.SIGCONT)
            assert limiter.fallbacks == 4
            assert warnings() == 1
            now[0] = 20.0
            limiter._leases.clear()
            assert (await limiter.check(key, 1)).allowed  # Redis again: the outage is over
            assert any("answers again" in record.getMessage() for record in caplog.records)
            os.kill(private_redis.process.pid, signal.SIGSTOP)
            try:
                now[0] = 30.0
                limiter._leases.clear()
                await limiter.check(key, 1)
            finally:
                os.kill(private_redis.process.pid, signal.SIGCONT)
            assert warnings() == 2  # a new outage warns again
        finally:
            await client.aclose()
