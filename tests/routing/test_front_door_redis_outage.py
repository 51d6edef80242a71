"""Redis going away with the front door on: keys keep working from the last good set, and rate
limits fall back to per-gateway buckets, never to "unlimited". A private redis-server is stopped."""

from __future__ import annotations

import httpx
import pytest
import redis.asyncio as aioredis

from tests.routing.support import (
    MODEL,
    gateway_config,
    make_key,
    make_node,
    make_snapshot,
    publish,
    publish_keys,
    running_gateway,
    wait_for,
)
from tests.routing.test_redis_outage import KEYS, private_redis  # noqa: F401  (fixture)

pytestmark = pytest.mark.e2e

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
OPEN = "gorgo-sk-open-unlimited-secret"
LIMITED = "gorgo-sk-lim-limited-secret"


class TestFrontDoorRedisOutage:
    async def test_keys_and_limits_hold_while_redis_is_down(self, private_redis, stubs):  # noqa: F811
        client = aioredis.Redis.from_url(private_redis.url)
        await publish(client, KEYS, make_snapshot((make_node(1, stubs[0].url),)))
        await publish_keys(
            client,
            KEYS,
            make_key(OPEN, key_id="open"),
            make_key(LIMITED, key_id="lim", requests_per_min=3),
            make_key("gorgo-sk-gone-revoked", key_id="gone", revoked=True),
        )
        await client.aclose()
        config = gateway_config(KEYS, private_redis.url, auth="on")
        async with running_gateway(config) as gateway, httpx.AsyncClient(base_url=gateway.url) as http:

            async def post(secret: str) -> int:
                answer = await http.post(
                    "/v1/chat/completions", json=BODY, headers={"Authorization": f"Bearer {secret}"}
                )
                return answer.status_code

            assert await post(LIMITED) == 200  # one of three, counted in Redis
            private_redis.stop()
            await wait_for(lambda: not gateway.app.runtime.store.redis_connected)
            during_open = [await post(OPEN) for _ in range(3)]
            during_revoked = await post("gorgo-sk-gone-revoked")
            during_limited = [await post(LIMITED) for _ in range(5)]
            limiter = gateway.app.runtime.front_door.limiter
            fallbacks = limiter.fallbacks

            # Redis is back (empty: it keeps nothing on disk). What this gateway admitted on its own
            # counts is charged to the shared bucket: 2 of the 3, so one more this minute. Before,
            # the bucket never heard of them and admitted 3 more.
            private_redis.start()
            client = aioredis.Redis.from_url(private_redis.url)
            await publish_keys(client, KEYS, make_key(LIMITED, key_id="lim", requests_per_min=3))
            await client.aclose()
            await wait_for(lambda: not limiter._owed, timeout_s=15)
            after_limited = [await post(LIMITED) for _ in range(2)]
        assert during_open == [200, 200, 200]
        assert during_revoked == 401
        # The local buckets start where the shared one stood at its last answer (2 of the 3 left;
        # they started full, which let this one gateway admit 4 in the minute): never more than
        # the limit, never unlimited.
        assert during_limited == [200, 200, 429, 429, 429]
        assert fallbacks >= 5
        assert after_limited == [200, 429]
