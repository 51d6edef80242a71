"""max_concurrent by leased slots (issue 24, item 2): exact across gateways, no Redis call per request.

Before, every admission of a key with ``max_concurrent`` was one Lua call: at 235 ms from Redis,
235 ms added to every such request. Real Redis, injected clocks, no sleeps.
"""

from __future__ import annotations

import asyncio
import random

from redis.asyncio import Redis

from routing.contract import RedisKeys
from routing.frontdoor.concurrency import ConcurrencyLimiter
from tests.conftest import free_port
from tests.routing.support import make_key

SECRET = "gorgo-sk-k1-leased-slots-secret"


class CountingRedis(Redis):
    """A limiter's client that counts the commands it sends (EVALSHA and the rest)."""

    commands = 0

    async def execute_command(self, *args, **options):
        self.commands += 1
        return await super().execute_command(*args, **options)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def counting_client(redis_url: str) -> CountingRedis:
    return CountingRedis.from_url(redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)


class TestLeasedSlots:
    async def test_two_gateways_never_exceed_the_limit(self, redis_url, redis_keys):
        # Random bursts of admissions and releases at two gateways: at no step more than 5 open.
        clients = [counting_client(redis_url) for _ in range(2)]
        clock = Clock()
        gateways = [
            ConcurrencyLimiter(client, redis_keys, f"gw-{index}", clock=clock)
            for index, client in enumerate(clients)
        ]
        key = make_key(SECRET, max_concurrent=5)
        rng = random.Random(24)
        held: list[list[int]] = [[], []]  # per gateway: one entry per open request
        admitted_at = [0, 0]
        refused = 0
        try:
            for step in range(300):
                index = rng.randrange(2)
                gateway = gateways[index]
                if held[index] and rng.random() < 0.45:
                    for _ in range(rng.randint(1, len(held[index]))):
                        held[index].pop()
                        gateway.release(key)
                else:
                    answers = await asyncio.gather(*(gateway.acquire(key) for _ in range(rng.randint(1, 4))))
                    for answer in answers:
                        if answer:
                            held[index].append(step)
                            admitted_at[index] += 1
                        else:
                            refused += 1
                assert len(held[0]) + len(held[1]) <= 5, step
                assert sum(g.open.get(key.id, 0) for g in gateways) == len(held[0]) + len(held[1])
                if step % 25 == 0:
                    clock.now += 0.5
                    await gateways[rng.randrange(2)].renew()  # idle slots go back to the fleet
        finally:
            for client in clients:
                await client.aclose()
        assert min(admitted_at) > 20 and refused > 0, (admitted_at, refused)

    async def test_the_steady_state_makes_no_redis_call_per_request(self, redis_url, redis_keys):
        client = counting_client(redis_url)
        clock = Clock()
        limiter = ConcurrencyLimiter(client, redis_keys, "gw-1", clock=clock)
        key = make_key(SECRET, max_concurrent=100)
        try:
            # Warm-up: 8 requests open at once take the lease.
            for _ in range(8):
                assert await limiter.acquire(key)
            before = client.commands
            # 1,000 requests, up to 8 open at a time, a renewal every 100 (0.5 s apart).
            for index in range(1000):
                limiter.release(key)
                assert await limiter.acquire(key)
                if index % 100 == 99:
                    clock.now += 0.5
                    await limiter.renew()
            calls = client.commands - before
        finally:
            await client.aclose()
        # None per request. Off the request path, one per renewal (every 0.5 s): the lease holds
        # headroom from the free slots (8 + a quarter of the 92 free = 31), which is re-sized on
        # the other gateways' leases at every renewal.
        assert calls == 10, calls
        assert limiter.slots[key.id].held == 31

    async def test_a_lease_sized_on_demand_is_rewritten_only_every_third_of_its_ttl(
        self, redis_url, redis_keys
    ):
        client = counting_client(redis_url)
        clock = Clock()
        limiter = ConcurrencyLimiter(client, redis_keys, "gw-1", clock=clock)
        key = make_key(SECRET, max_concurrent=10)
        try:
            for _ in range(8):  # 8 of 10: the demand's headroom (2) is larger than the free's
                assert await limiter.acquire(key)
            before, lease_calls = client.commands, limiter.calls
            for _ in range(10):
                clock.now += 0.5
                await limiter.renew()
            calls = client.commands - before
            lease_calls = limiter.calls - lease_calls
        finally:
            await client.aclose()
        assert lease_calls == 1, lease_calls  # the rewrite once a third of its ttl had passed
        # and at each of the nine renewals without a call, one GET of the epoch (did Redis lose it?)
        assert calls == 10, calls
        assert limiter.slots[key.id].held == 10

    async def test_far_from_the_limit_a_burst_needs_no_round_trip(self, redis_url, redis_keys):
        # At 235 ms from Redis, a lease grown by doubling made a burst of 40 wait five round trips
        # (routing_quality --shared-state wan measured it); headroom from the free slots covers it.
        client = counting_client(redis_url)
        limiter = ConcurrencyLimiter(client, redis_keys, "gw-1", clock=Clock())
        key = make_key(SECRET, max_concurrent=1000)
        try:
            assert await limiter.acquire(key)
            for _ in range(40):
                assert await limiter.acquire(key)
        finally:
            await client.aclose()
        assert limiter.calls == 1, limiter.calls
        assert limiter.slots[key.id].held == 250  # a quarter of the limit at most

    async def test_headroom_shrinks_as_the_fleet_nears_the_limit(self, redis_url, redis_keys):
        clients = [counting_client(redis_url) for _ in range(2)]
        clock = Clock()
        a = ConcurrencyLimiter(clients[0], redis_keys, "gw-a", clock=clock)
        b = ConcurrencyLimiter(clients[1], redis_keys, "gw-b", clock=clock)
        key = make_key(SECRET, max_concurrent=100)
        try:
            assert all([await a.acquire(key) for _ in range(40)])
            clock.now += 0.5
            await a.renew()
            assert a.slots[key.id].held == 55  # 40 open + a quarter of the 60 free
            assert all([await b.acquire(key) for _ in range(40)])  # from the 45 a left
            for _ in range(2):  # the first renewal learns b's lease, the second sizes on it
                clock.now += 0.5
                await a.renew()
            # 40 open + a quarter of the demand: only 15 were free after b's 45
            assert a.slots[key.id].held == 50
            assert a.slots[key.id].held + b.slots[key.id].held <= 100
        finally:
            for client in clients:
                await client.aclose()

    async def test_concurrent_misses_share_one_call_and_take_exactly_the_limit(self, redis_url, redis_keys):
        client = counting_client(redis_url)
        limiter = ConcurrencyLimiter(client, redis_keys, "gw-1", clock=Clock())
        key = make_key(SECRET, max_concurrent=10)
        try:
            answers = await asyncio.gather(*(limiter.acquire(key) for _ in range(50)))
            commands = client.commands
        finally:
            await client.aclose()
        assert sum(answers) == 10
        assert limiter.calls <= 3 and commands <= 6, (limiter.calls, commands)  # + SCRIPT LOAD on first use

    async def test_a_dead_gateways_lease_returns_after_its_expiry(self, redis_url, redis_keys):
        clients = [counting_client(redis_url) for _ in range(2)]
        dead = ConcurrencyLimiter(clients[0], redis_keys, "gw-dead", lease_ttl_s=10.0, clock=Clock())
        live = ConcurrencyLimiter(clients[1], redis_keys, "gw-live", lease_ttl_s=10.0, clock=Clock())
        key = make_key(SECRET, max_concurrent=3)
        lease_hash = redis_keys.concurrency(key.id)
        try:
            for _ in range(3):
                assert await dead.acquire(key)
            # The gateway dies with its three requests open: no release, no renewal, no goodbye.
            assert not await live.acquire(key)
            slots, expires_ms = (await clients[1].hget(lease_hash, "gw-dead")).split(b":")
            seconds, micros = await clients[1].time()
            now_ms = seconds * 1000 + micros // 1000
            assert slots == b"3" and 9_000 < int(expires_ms) - now_ms <= 10_000
            # Redis's clock passes the lease's expiry (written as Redis would see it 10 s later).
            await clients[1].hset(lease_hash, "gw-dead", f"3:{now_ms - 1}")
            assert all([await live.acquire(key) for _ in range(3)])
            assert await clients[1].hget(lease_hash, "gw-dead") is None  # cleaned up
            assert not await live.acquire(key)
        finally:
            for client in clients:
                await client.aclose()

    async def test_a_lease_past_its_ttl_is_not_trusted_locally(self, redis_url, redis_keys):
        # A gateway whose renewals stopped must not admit from a lease Redis has already dropped.
        client = counting_client(redis_url)
        clock = Clock()
        limiter = ConcurrencyLimiter(client, redis_keys, "gw-1", lease_ttl_s=10.0, clock=clock)
        key = make_key(SECRET, max_concurrent=8)
        try:
            assert await limiter.acquire(key)
            calls = limiter.calls
            limiter.release(key)
            assert await limiter.acquire(key)
            assert limiter.calls == calls  # from the lease
            limiter.release(key)
            clock.now += 10.0
            assert await limiter.acquire(key)
            assert limiter.calls == calls + 1  # asked again
        finally:
            await client.aclose()

    async def test_idle_slots_go_back_to_the_fleet_within_two_renewals(self, redis_url, redis_keys):
        clients = [counting_client(redis_url) for _ in range(2)]
        clock = Clock()
        a = ConcurrencyLimiter(clients[0], redis_keys, "gw-a", clock=clock)
        b = ConcurrencyLimiter(clients[1], redis_keys, "gw-b", clock=clock)
        key = make_key(SECRET, max_concurrent=4)
        try:
            assert all([await a.acquire(key) for _ in range(4)])
            for _ in range(4):
                a.release(key)
            assert not await b.acquire(key)  # a still leases the four (no renewal yet)
            await a.renew()  # the window that saw four open: keeps them
            await a.renew()  # a window with none: gives them back
            assert all([await b.acquire(key) for _ in range(4)])
            assert not await a.acquire(key)
        finally:
            for client in clients:
                await client.aclose()

    async def test_close_gives_the_lease_back(self, redis_url, redis_keys):
        client = counting_client(redis_url)
        limiter = ConcurrencyLimiter(client, redis_keys, "gw-1", clock=Clock())
        key = make_key(SECRET, max_concurrent=4)
        try:
            assert await limiter.acquire(key)
            limiter.release(key)
            await limiter.close()
            assert await client.hget(redis_keys.concurrency(key.id), "gw-1") is None
        finally:
            await client.aclose()


async def _lose_everything(client: Redis, keys: RedisKeys) -> None:
    """What a Redis restarted without persistence (or flushed, or failed over to an empty replica)
    looks like to the gateways: every key of the namespace gone."""
    names = [name async for name in client.scan_iter(match=f"{keys.prefix}:*")]
    if names:
        await client.delete(*names)


async def _leased(client: Redis, lease_hash: str) -> dict[str, int]:
    return {
        field.decode(): int(value.split(b":")[0])
        for field, value in (await client.hgetall(lease_hash)).items()
    }


class TestRedisLosesItsState:
    """Redis restarted empty while the gateways hold leases: the first gateway to call used to see no
    other lease and take the whole limit while the others went on admitting from theirs, up to
    twice the limit until their next rewrite (a third of the ttl, ~3.3 s) and as long as both
    kept their requests open."""

    async def test_the_fleet_stays_within_the_limit(self, redis_url, redis_keys):
        clients = [counting_client(redis_url) for _ in range(2)]
        clock = Clock()
        a = ConcurrencyLimiter(clients[0], redis_keys, "gw-a", clock=clock)
        b = ConcurrencyLimiter(clients[1], redis_keys, "gw-b", clock=clock)
        key = make_key(SECRET, max_concurrent=8)
        lease_hash = redis_keys.concurrency(key.id)
        try:
            assert await b.acquire(key)
            b.release(key)
            assert all([await a.acquire(key) for _ in range(6)])
            await b.renew()
            await b.renew()  # b idle: its lease goes back
            await _lose_everything(clients[0], redis_keys)
            # b's clients arrive first after the restart and take what they can.
            for _ in range(10):
                if not await b.acquire(key):
                    break
            assert a.open[key.id] + b.open.get(key.id, 0) <= 8, (a.open, b.open)
            # a, still admitting from the lease it held, re-asserts it at its next renewal, which
            # reads the lost state (no wait for its lease's rewrite).
            while await a.acquire(key):
                pass
            await a.renew()
            assert a.open[key.id] + b.open.get(key.id, 0) <= 8, (a.open, b.open)
            assert sum((await _leased(clients[0], lease_hash)).values()) <= 8
            assert "gw-a" in await _leased(clients[0], lease_hash)
        finally:
            for client in clients:
                await client.aclose()

    async def test_growth_resumes_once_the_recovery_window_ends(self, redis_url, redis_keys):
        clients = [counting_client(redis_url) for _ in range(2)]
        clock = Clock()
        a = ConcurrencyLimiter(clients[0], redis_keys, "gw-a", clock=clock)
        b = ConcurrencyLimiter(clients[1], redis_keys, "gw-b", clock=clock)
        key = make_key(SECRET, max_concurrent=8)
        try:
            assert all([await a.acquire(key) for _ in range(2)])
            await _lose_everything(clients[0], redis_keys)
            await a.renew()  # a finds the state lost and re-asserts its lease: the window opens
            assert await b.acquire(key) is False  # a new lease waits for every live one to return
            # Redis's clock passes the window's end (written as it would read then).
            epoch_key = redis_keys.limits_epoch
            token, _until = (await clients[0].get(epoch_key)).rsplit(b":", 1)
            await clients[0].set(epoch_key, token + b":1")
            assert all([await b.acquire(key) for _ in range(4)])  # 8 - a's lease (2 + headroom)
        finally:
            for client in clients:
                await client.aclose()

    async def test_a_new_fleet_is_not_held_back(self, redis_url, redis_keys):
        # No epoch because nothing was ever leased under this namespace, not because it was lost.
        client = counting_client(redis_url)
        limiter = ConcurrencyLimiter(client, redis_keys, "gw-1", clock=Clock())
        key = make_key(SECRET, max_concurrent=5)
        try:
            assert all(await asyncio.gather(*(limiter.acquire(key) for _ in range(5))))
            assert not await limiter.acquire(key)
        finally:
            await client.aclose()


class TestRedisDown:
    async def test_each_gateway_counts_on_its_own_never_unlimited(self):
        dead = CountingRedis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=0.2)
        clock = Clock()
        limiter = ConcurrencyLimiter(dead, RedisKeys(prefix="unused"), "gw-1", clock=clock, retry_after_s=1.0)
        key = make_key(SECRET, max_concurrent=2)
        try:
            assert await limiter.acquire(key)
            assert await limiter.acquire(key)
            assert not await limiter.acquire(key)  # the full limit, on this gateway's own count
            limiter.release(key)
            assert await limiter.acquire(key)
            clock.now += 1.0  # Redis is tried again, still down: still the local count
            limiter.release(key)
            assert await limiter.acquire(key)
            assert not await limiter.acquire(key)
            await limiter.renew()  # skipped while Redis is down
        finally:
            await dead.aclose()
        assert limiter.fallbacks == 4
        assert limiter.backoff.down
