"""A key's first request at a gateway, with Redis a WAN round trip away (issue 24, item 2).

The routing benchmark (``--shared-state wan --front-door``) measured the far gateways' first
requests spending three round trips in the gateway: one to connect, one for the concurrency slot,
then one for the rate lease. The connection and scripts are now warmed at start, and the first
rate lease is taken while the slot's call is out. Real Redis; nothing here waits for time.
"""

from __future__ import annotations

from collections.abc import Callable

from redis.asyncio import Redis

from routing.frontdoor.concurrency import ConcurrencyLimiter
from routing.frontdoor.front_door import FrontDoor
from routing.frontdoor.keystore import KeyStore
from routing.frontdoor.ratelimit import RateLimiter
from routing.observability.exporter import GatewayMetrics
from tests.routing.support import make_key

SECRET = "gorgo-sk-cold-start-0123456789abcdef"


class CountingRedis(Redis):
    commands: list[str]
    on_command: Callable[[tuple], None] | None = None  # sees each command as it is sent

    async def execute_command(self, *args, **options):
        self.commands.append(str(args[0]))
        if self.on_command is not None:
            self.on_command(args)
        return await super().execute_command(*args, **options)


def counting(redis_url: str) -> CountingRedis:
    client = CountingRedis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
    client.commands = []
    return client


async def test_the_first_rate_lease_is_taken_while_the_slot_call_is_out(redis_url, redis_keys):
    client = counting(redis_url)
    key = make_key(SECRET, max_concurrent=10, requests_per_min=6000, tokens_per_min=6_000_000)
    store = KeyStore(client, redis_keys)
    store.by_hash = {key.secret_sha256: key}
    limiter = RateLimiter(client, redis_keys)
    concurrency = ConcurrencyLimiter(client, redis_keys, "gw-1")
    door = FrontDoor("us-east", store, limiter, concurrency, GatewayMetrics())
    seen_during_slot_call: list[bool] = []

    def observe(command: tuple) -> None:
        # The slot's lease script going out: is the rate lease call out too? (The limiters may be
        # compiled, routing/native.py, so the test watches the client rather than patching them.)
        if command[0] == "EVALSHA" and command[1] == concurrency._lease.sha:
            seen_during_slot_call.append(key.id in limiter._calls)

    client.on_command = observe
    try:
        grant = await door.admit(key, "m", 100)
        assert seen_during_slot_call == [True]
        assert b"x-ratelimit-remaining-requests" in grant.head
        # The second request: both from memory, no Redis call.
        before = len(client.commands)
        door.done(key, grant, None, 200)
        assert b"x-ratelimit-remaining-requests" in (await door.admit(key, "m", 100)).head
        assert len(client.commands) == before
    finally:
        for task in list(limiter._refills):
            await task
        await client.delete(redis_keys.rate_limit(key.id), redis_keys.concurrency(key.id))
        await client.aclose()


async def test_start_connects_and_loads_the_scripts_before_any_request(redis_url, redis_keys):
    client = counting(redis_url)
    limiter = RateLimiter(client, redis_keys)
    concurrency = ConcurrencyLimiter(client, redis_keys, "gw-1")
    try:
        limiter.start()
        concurrency.start()
        assert limiter._warming is not None and concurrency._warming is not None
        await limiter._warming
        await concurrency._warming
        # Connected and idle before any request: the first one does not pay the connection.
        assert client.connection_pool._available_connections
        shas = [limiter._check.sha, limiter._settle.sha, concurrency._lease.sha]
        assert await client.script_exists(*shas) == [True, True, True]
    finally:
        await limiter.close()
        await concurrency.close()
        await client.aclose()
