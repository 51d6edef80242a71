"""Per-key limits shared by every gateway through Redis: requests, tokens, concurrency, fallback."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from routing.contract import RedisKeys, RequestRecord, decode
from routing.frontdoor.concurrency import ConcurrencyLimiter
from routing.frontdoor.ratelimit import RateLimiter, make_limiter_redis
from tests.conftest import free_port
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

SECRET = "gorgo-sk-k1-rate-limited-secret"
AUTH = {"Authorization": f"Bearer {SECRET}"}
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


async def setup(aredis, redis_keys, stubs, **limits):
    await publish(aredis, redis_keys, make_snapshot((make_node(1, stubs[0].url),)))
    await publish_keys(aredis, redis_keys, make_key(SECRET, **limits))


class TestRateLimits:
    async def test_it_answers_429_with_openai_headers_past_the_request_limit(
        self, aredis, redis_keys, redis_url, stubs
    ):
        await setup(aredis, redis_keys, stubs, requests_per_min=5)
        async with running_gateway(gateway_config(redis_keys, redis_url, auth="on")) as gateway:
            answers = [
                await gateway.http.post("/v1/chat/completions", json=BODY, headers=AUTH) for _ in range(8)
            ]
            metrics = (await gateway.http.get("/metrics")).text
        assert [answer.status_code for answer in answers] == [200] * 5 + [429] * 3
        first, refused = answers[0], answers[-1]
        assert first.headers["x-ratelimit-limit-requests"] == "5"
        assert first.headers["x-ratelimit-remaining-requests"] == "4"
        assert first.headers["x-ratelimit-reset-requests"].endswith("s")
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert int(refused.headers["retry-after"]) >= 1 and int(refused.headers["retry-after-ms"]) > 0
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"
        assert 'gorgo_gateway_rate_limited_total{key_id="k1",reason="requests"} 3.0' in metrics

    async def test_two_gateways_share_one_limit(self, aredis, redis_keys, redis_url, stubs):
        await setup(aredis, redis_keys, stubs, requests_per_min=40)
        first = gateway_config(redis_keys, redis_url, auth="on", gateway_id="gw-a")
        second = gateway_config(redis_keys, redis_url, auth="on", gateway_id="gw-b")
        async with running_gateway(first) as a, running_gateway(second) as b:
            statuses = []
            for index in range(80):
                gateway = a if index % 2 else b
                statuses.append(
                    (await gateway.http.post("/v1/chat/completions", json=BODY, headers=AUTH)).status_code
                )
        admitted = statuses.count(200)
        assert 40 <= admitted <= 44, statuses  # the limit, plus what refilled meanwhile (within 10%)

    async def test_it_charges_the_prompt_estimate_and_settles_with_usage(
        self, aredis, redis_keys, redis_url, stubs
    ):
        await setup(aredis, redis_keys, stubs, tokens_per_min=1000)
        body = {**BODY, "messages": [{"role": "user", "content": "x" * 2000}]}  # ~500 tokens estimated
        async with running_gateway(gateway_config(redis_keys, redis_url, auth="on")) as gateway:
            first = await gateway.http.post("/v1/chat/completions", json=body, headers=AUTH)
            remaining_after_charge = int(first.headers["x-ratelimit-remaining-tokens"])
            # The stub reports 42 prompt + 3 completion tokens: most of the charge comes back.
            await wait_for(
                lambda: aredis.hget(redis_keys.rate_limit("k1"), "t"),
            )

            async def settled() -> bool:
                level = float(await aredis.hget(redis_keys.rate_limit("k1"), "t"))
                return level > remaining_after_charge + 400

            await wait_for(settled)
            second = await gateway.http.post("/v1/chat/completions", json=body, headers=AUTH)
            third = await gateway.http.post("/v1/chat/completions", json=body, headers=AUTH)
        assert remaining_after_charge < 600
        assert second.status_code == 200
        assert third.status_code in (200, 429)
        assert second.headers["x-ratelimit-limit-tokens"] == "1000"

    async def test_it_caps_concurrent_requests_per_key(self, aredis, redis_keys, redis_url, stubs):
        await setup(aredis, redis_keys, stubs, max_concurrent=1)
        slow = {**BODY, "stub": {"delay_s": 0.5}}
        async with running_gateway(gateway_config(redis_keys, redis_url, auth="on")) as gateway:
            answers = await asyncio.gather(
                gateway.http.post("/v1/chat/completions", json=slow, headers=AUTH),
                gateway.http.post("/v1/chat/completions", json=slow, headers=AUTH),
            )
            after = await gateway.http.post("/v1/chat/completions", json=BODY, headers=AUTH)
        assert sorted(answer.status_code for answer in answers) == [200, 429]
        assert after.status_code == 200  # the slot was given back

    async def test_a_key_without_limits_costs_no_redis_call(self, aredis, redis_keys, redis_url, stubs):
        await setup(aredis, redis_keys, stubs)
        async with running_gateway(gateway_config(redis_keys, redis_url, auth="on")) as gateway:
            answer = await gateway.http.post("/v1/chat/completions", json=BODY, headers=AUTH)
            assert "x-ratelimit-limit-requests" not in answer.headers
        assert not await aredis.exists(redis_keys.rate_limit("k1"))


class TestFleetConcurrency:
    """max_concurrent holds across gateways: each admits from slots it leased from the shared limit."""

    async def test_two_gateways_share_one_concurrency_limit(self, aredis, redis_keys, redis_url, stubs):
        # Before: counted per gateway process, so two gateways admitted twice the limit.
        await setup(aredis, redis_keys, stubs, max_concurrent=2)
        slow = {**BODY, "stub": {"delay_s": 1.0}}
        first = gateway_config(redis_keys, redis_url, auth="on", gateway_id="gw-a")
        second = gateway_config(redis_keys, redis_url, auth="on", gateway_id="gw-b")
        async with running_gateway(first) as a, running_gateway(second) as b:
            held = [
                asyncio.create_task(a.http.post("/v1/chat/completions", json=slow, headers=AUTH))
                for _ in range(2)
            ]

            async def both_open_at_a() -> bool:
                value = await aredis.hget(redis_keys.concurrency("k1"), "gw-a")
                return value is not None and value.split(b":")[0] == b"2"

            await wait_for(both_open_at_a, timeout_s=2.0)
            refused = await b.http.post("/v1/chat/completions", json=BODY, headers=AUTH)
            answers = await asyncio.gather(*held)

            async def admitted_again() -> bool:
                answer = await b.http.post("/v1/chat/completions", json=BODY, headers=AUTH)
                return answer.status_code == 200

            await wait_for(admitted_again, timeout_s=2.0)  # a's slots came back
        assert [answer.status_code for answer in answers] == [200, 200]
        assert refused.status_code == 429
        assert "concurrent" in refused.json()["error"]["message"]

    # A dead gateway's slots, idle slots going back and the lease protocol itself:
    # tests/routing/test_concurrency_leases.py.


class TestRedisDownFallback:
    async def test_concurrency_falls_back_to_this_gateways_count(self):
        dead = make_limiter_redis(f"redis://127.0.0.1:{free_port()}/0", 0.2)
        limiter = ConcurrencyLimiter(dead, RedisKeys(prefix="unused"), "gw-1")
        key = make_key(SECRET, max_concurrent=1)
        try:
            assert await limiter.acquire(key)
            assert not await limiter.acquire(key)  # never "unlimited"
            limiter.release(key)
            assert await limiter.acquire(key)
        finally:
            await dead.aclose()
        assert limiter.fallbacks == 2

    async def test_it_falls_back_to_local_limits_never_to_unlimited(self):
        dead = make_limiter_redis(f"redis://127.0.0.1:{free_port()}/0", 0.2)
        limiter = RateLimiter(dead, RedisKeys(prefix="unused"))
        key = make_key(SECRET, requests_per_min=3)
        try:
            verdicts = [await limiter.check(key, 10) for _ in range(5)]
        finally:
            await dead.aclose()
        assert [verdict.allowed for verdict in verdicts] == [True, True, True, False, False]
        assert limiter.fallbacks == 5
        assert verdicts[-1].retry_after_s > 0

    async def test_it_uses_redis_again_once_it_answers(self, redis_url, redis_keys):
        limiter = RateLimiter(make_limiter_redis(redis_url, 0.25), redis_keys, retry_after_s=0.05)
        limiter.backoff.until = time.monotonic() + 0.05  # as after a failure
        key = make_key(SECRET, requests_per_min=100)
        await limiter.check(key, 1)
        await asyncio.sleep(0.06)
        await limiter.check(key, 1)
        assert limiter.fallbacks == 1

    async def test_what_it_admitted_during_an_outage_is_charged_once_redis_answers(
        self, aredis, redis_url, redis_keys
    ):
        # A 5/min key: 3 admitted on the local counts while Redis was skipped. Before, the shared
        # bucket never heard of them and admitted 5 more in the same minute (8 in all).
        limiter = RateLimiter(make_limiter_redis(redis_url, 0.25), redis_keys, retry_after_s=0.05)
        key = make_key(SECRET, requests_per_min=5, tokens_per_min=1_000)
        try:
            limiter.backoff.until = time.monotonic() + 60  # as after a failure
            outage = [await limiter.check(key, 100) for _ in range(3)]
            assert [verdict.allowed for verdict in outage] == [True] * 3 and limiter.fallbacks == 3
            await limiter._flush()  # still skipped: kept, not dropped
            assert await aredis.exists(redis_keys.rate_limit(key.id)) == 0
            limiter.backoff.until = 0.0  # Redis answers again
            await limiter._flush()
            bucket = await aredis.hgetall(redis_keys.rate_limit(key.id))
            assert float(bucket[b"r"]) == pytest.approx(2, abs=0.01)
            assert float(bucket[b"t"]) == pytest.approx(700, abs=1)
            after = [await limiter.check(key, 100) for _ in range(3)]
        finally:
            await limiter.close()
        assert [verdict.allowed for verdict in after] == [True, True, False]
        assert limiter.fallbacks == 3

    async def test_a_failed_charge_is_kept_for_the_next_flush(self, redis_url, redis_keys):
        dead = make_limiter_redis(f"redis://127.0.0.1:{free_port()}/0", 0.2)
        limiter = RateLimiter(dead, redis_keys, retry_after_s=0.05)
        key = make_key(SECRET, requests_per_min=5)
        try:
            assert (await limiter.check(key, 1)).allowed  # the call fails: counted locally
            await asyncio.sleep(0.06)
            await limiter._flush()  # fails again
        finally:
            await dead.aclose()
        assert limiter._owed == {(key.id, 5, 0): [1, 0]}


class TestLeases:
    async def test_a_gateway_leases_a_slice_of_the_limit_so_most_requests_skip_redis(
        self, redis_url, redis_keys
    ):
        client = make_limiter_redis(redis_url, 0.25)
        limiter = RateLimiter(client, redis_keys, lease_fraction=0.01)
        key = make_key(SECRET, requests_per_min=300)  # leases of 3 requests beyond the one asked for
        try:
            levels = []
            for _ in range(5):
                verdict = await limiter.check(key, 1)
                assert verdict.allowed
                if limiter._refills:  # a refill runs in the background; let it land before reading
                    await asyncio.wait(limiter._refills)
                levels.append(float(await client.hget(redis_keys.rate_limit(key.id), "r")))
        finally:
            await client.aclose()
        # One script call took 1 + 3; the rest came from the lease, which was refilled in the
        # background each time it fell to half its slice (third and fifth requests: 1 + 1 each), so
        # no request after the first waited for Redis (issue 24).
        assert [round(level) for level in levels] == [296, 296, 294, 294, 292]
        assert verdict.headers[1] == (b"x-ratelimit-remaining-requests", b"295")

    async def test_a_busy_key_refills_its_lease_before_a_request_finds_it_empty(self, redis_url, redis_keys):
        # Issue 24: with Redis 235 ms away, every request that found the lease empty (one in 60
        # here) waited that round trip. Refills now start at half the slice, in the background.
        client = make_limiter_redis(redis_url, 1.0)
        limiter = RateLimiter(client, redis_keys, lease_fraction=0.01)
        key = make_key(SECRET, requests_per_min=6000, tokens_per_min=1_000_000)  # slices: 60, 10,000
        waited = 0
        evalsha = client.evalsha

        async def counted(*args):
            # Counted at the client (the limiter may be compiled: its methods cannot be replaced):
            # a script call outside the named background refill is one a request waited for.
            nonlocal waited
            if asyncio.current_task().get_name() != "gorgo-ratelimit-refill":
                waited += 1
            return await evalsha(*args)

        client.evalsha = counted
        try:
            for _ in range(500):
                assert (await limiter.check(key, 10)).allowed
                refills = getattr(limiter, "_refills", ())  # (none before issue 24)
                if refills:  # the refill's round trip, shorter than half a lease of requests
                    await asyncio.wait(refills)
            level = float(await client.hget(redis_keys.rate_limit(key.id), "r"))
        finally:
            await client.aclose()
        assert waited == 1  # only the first request, which found no lease at all
        assert 6000 - 500 - 60 <= level <= 6000 - 500  # never more taken than used plus one slice

    async def test_answers_from_a_lease_carry_the_same_headers_as_the_scripts(self, redis_url, redis_keys):
        # A lease builds its x-ratelimit-* headers once; only the remaining counts change per request.
        client = make_limiter_redis(redis_url, 0.25)
        limiter = RateLimiter(client, redis_keys, lease_fraction=0.01)
        both = make_key(SECRET, requests_per_min=6000, tokens_per_min=100_000)
        tokens_only = make_key("gorgo-sk-k2-tokens", key_id="k2", tokens_per_min=100_000)
        try:
            answers = [await limiter.check(both, 10) for _ in range(3)]
            token_answers = [await limiter.check(tokens_only, 10) for _ in range(3)]
        finally:
            await client.aclose()
        names = [name.decode() for name, _ in answers[0].headers]
        assert names == [
            "x-ratelimit-limit-requests",
            "x-ratelimit-remaining-requests",
            "x-ratelimit-reset-requests",
            "x-ratelimit-limit-tokens",
            "x-ratelimit-remaining-tokens",
            "x-ratelimit-reset-tokens",
        ]
        for answer in answers[1:]:
            assert [name for name, _ in answer.headers] == [name for name, _ in answers[0].headers]
        fields = [dict(answer.headers) for answer in answers]
        assert [int(f[b"x-ratelimit-remaining-requests"]) for f in fields] == [5999, 5998, 5997]
        assert [int(f[b"x-ratelimit-remaining-tokens"]) for f in fields] == [99_990, 99_980, 99_970]
        assert {f[b"x-ratelimit-limit-tokens"] for f in fields} == {b"100000"}
        token_fields = [dict(answer.headers) for answer in token_answers]
        assert all(len(answer.headers) == 3 for answer in token_answers)
        assert [int(f[b"x-ratelimit-remaining-tokens"]) for f in token_fields] == [99_990, 99_980, 99_970]

    def test_a_charged_request_never_reads_as_the_full_limit_remaining(self):
        # Seen under `make run`: x-ratelimit-remaining-requests 6000 on a 6000/min key right after a
        # request. The bucket had refilled to full while the gateway still held leased allowance.
        from routing.frontdoor.ratelimit import _Lease

        key = make_key(SECRET, requests_per_min=6000, tokens_per_min=100_000)
        # The script's answer: the shared buckets full again (less this request), 59 requests and
        # 900 tokens still leased here.
        lease = _Lease(key, 59, 900, [1, 0, 5999, 10, 99_990, 10, 0, 0, 0])
        fields = dict(lease.headers(10))
        assert int(fields[b"x-ratelimit-remaining-requests"]) == 5999
        assert int(fields[b"x-ratelimit-remaining-tokens"]) == 99_990
        assert fields[b"x-ratelimit-limit-requests"] == b"6000"

    def test_a_lease_writes_the_same_fields_as_head_bytes(self):
        # The answer's head takes a lease's headers as bytes (_Lease.head, built from pieces made
        # once per lease): the same fields, in the same order, as header_lines of its headers.
        from routing.frontdoor.ratelimit import _Lease, header_lines

        raw = [1, 0, 5999, 10, 99_990, 10, 0, 0, 0]
        for limits in (
            {"requests_per_min": 6000, "tokens_per_min": 100_000},
            {"requests_per_min": 6000},
            {"tokens_per_min": 100_000},
            {},
        ):
            key = make_key(SECRET, **limits)
            for requests, tokens, cost in ((59, 900, 10), (0, 0, 0), (10_000, 10**6, 5000)):
                lease = _Lease(key, requests, tokens, raw)
                assert lease.head(cost) == header_lines(lease.headers(cost)), limits

    async def test_a_lease_short_of_tokens_does_not_hoard_requests(self, redis_url, redis_keys):
        # Seen under `make run`: x-ratelimit-remaining-requests 6688 for a 6000/min key, because each
        # refill for tokens carried the unused requests over and added a fresh slice on top.
        client = make_limiter_redis(redis_url, 0.25)
        limiter = RateLimiter(client, redis_keys, lease_fraction=0.01)
        key = make_key(SECRET, requests_per_min=6000, tokens_per_min=100_000)  # slices: 60 and 1,000
        try:
            verdicts = [await limiter.check(key, 400) for _ in range(40)]
        finally:
            await client.aclose()
        assert all(verdict.allowed for verdict in verdicts)
        assert limiter._leases[key.id].requests <= 60
        remaining = [int(dict(verdict.headers)[b"x-ratelimit-remaining-requests"]) for verdict in verdicts]
        assert max(remaining) <= 6000


class TestConcurrentMisses:
    """Issue 22, item 4: concurrent requests that miss the lease each took one and only the last
    was kept, so 200 concurrent requests to a fresh 120/min key admitted 61."""

    async def test_200_concurrent_requests_to_a_120_per_min_key_admit_nearly_all_of_it(
        self, redis_url, redis_keys
    ):
        client = make_limiter_redis(redis_url, 1.0)
        limiter = RateLimiter(client, redis_keys, lease_fraction=0.01)
        key = make_key(SECRET, requests_per_min=120)
        try:
            verdicts = await asyncio.gather(*(limiter.check(key, 1) for _ in range(200)))
        finally:
            await client.aclose()
        admitted = sum(verdict.allowed for verdict in verdicts)
        # Never more than the allowance; a request's worth may refill while the burst runs.
        assert 114 <= admitted <= 121, admitted
        assert limiter.fallbacks == 0

    async def test_two_gateways_splitting_a_burst_admit_the_allowance_between_them(
        self, redis_url, redis_keys
    ):
        clients = [make_limiter_redis(redis_url, 1.0) for _ in range(2)]
        limiters = [RateLimiter(client, redis_keys, lease_fraction=0.01) for client in clients]
        key = make_key(SECRET, requests_per_min=600, tokens_per_min=600_000)  # leases of 6 and 6,000
        try:
            verdicts = await asyncio.gather(*(limiters[index % 2].check(key, 100) for index in range(680)))
        finally:
            for client in clients:
                await client.aclose()
        admitted = sum(verdict.allowed for verdict in verdicts)
        assert 570 <= admitted <= 601, admitted
        # What the gateways still hold unused is at most their two leases.
        held = sum(limiter._leases[key.id].requests for limiter in limiters if key.id in limiter._leases)
        assert held <= 12

    async def test_sustained_concurrency_admits_what_the_bucket_holds(self, redis_url, redis_keys):
        # 20 requests at a time, ten waves: the shared bucket (100/min) is emptied exactly, and no
        # wave's requests are lost to overwritten leases.
        client = make_limiter_redis(redis_url, 1.0)
        limiter = RateLimiter(client, redis_keys, lease_fraction=0.05)
        key = make_key(SECRET, requests_per_min=100)
        try:
            admitted = 0
            for _ in range(10):
                verdicts = await asyncio.gather(*(limiter.check(key, 1) for _ in range(20)))
                admitted += sum(verdict.allowed for verdict in verdicts)
        finally:
            await client.aclose()
        assert 95 <= admitted <= 101, admitted

    async def test_a_refused_call_refuses_its_waiters_without_asking_again(self, redis_url, redis_keys):
        client = make_limiter_redis(redis_url, 1.0)
        limiter = RateLimiter(client, redis_keys, lease_fraction=0.01)
        key = make_key(SECRET, requests_per_min=2)
        calls = 0
        evalsha = client.evalsha

        async def counted(*args):
            nonlocal calls  # counted at the client: a compiled limiter's attributes are fixed
            calls += 1
            return await evalsha(*args)

        client.evalsha = counted
        try:
            verdicts = await asyncio.gather(*(limiter.check(key, 1) for _ in range(50)))
        finally:
            await client.aclose()
        assert sum(verdict.allowed for verdict in verdicts) == 2
        assert calls <= 3, calls


async def test_a_leases_admissions_stop_once_the_keys_real_usage_has_spent_it(redis_url, redis_keys) -> None:
    """tokens/min 100,000, prompts estimated at 50 tokens, answers of ~1,000 (the usual chat shape):
    the lease was charged the estimate only and the rest went to Redis as debt, which the lease
    never saw, so it went on admitting: ~116,550 tokens used before the first 429 with the default
    1 % lease (leases off: ~100,800). Each answer is settled before the next request."""
    from routing.frontdoor.ratelimit import RateLimiter

    tpm, estimate, used = 100_000, 50, 1_050
    client = make_limiter_redis(redis_url, 1.0)
    limiter = RateLimiter(client, redis_keys, lease_fraction=0.01)
    key = make_key("gorgo-sk-k1-debt-secret", requests_per_min=10_000, tokens_per_min=tpm)
    spent = 0
    try:
        for _ in range(1_000):
            verdict = await limiter.check(key, estimate)
            if not verdict.allowed:
                break
            spent += used
            limiter.settle(key, estimate, used)  # what FrontDoor.done does with the node's usage
            await limiter._flush()  # the settle loop, at once
            if limiter._refills:
                await asyncio.wait(limiter._refills)
    finally:
        await client.aclose()
    assert spent <= tpm + used + tpm // 100  # the documented slack: one lease slice, one request


async def test_a_prompt_larger_than_a_minutes_tokens_is_settled_from_what_it_was_charged(
    redis_url, redis_keys
) -> None:
    """The limiter charges a prompt at most a minute's tokens (the script's cap), but the grant
    recorded the whole estimate, so settling forgave estimate - tpm of the real usage: a 30k-token
    prompt on a 10k tokens/min key left the bucket at -500 instead of the -10,000 floor."""
    from routing.frontdoor.front_door import FrontDoor
    from routing.frontdoor.keystore import KeyStore
    from routing.frontdoor.ratelimit import RateLimiter
    from routing.http.usage import Usage
    from routing.observability.exporter import GatewayMetrics

    tpm = 10_000
    client = make_limiter_redis(redis_url, 1.0)
    limiter = RateLimiter(client, redis_keys, lease_fraction=0.0)
    door = FrontDoor(
        "eu-west",
        KeyStore(client, redis_keys),
        limiter,
        ConcurrencyLimiter(client, redis_keys, "gw-1"),  # the key has no max_concurrent
        GatewayMetrics(),
    )
    key = make_key("gorgo-sk-k1-big-secret", tokens_per_min=tpm)
    try:
        grant = await door.admit(key, "m", 30_000)  # admitted from a full bucket
        door.done(key, grant, Usage(prompt_tokens=30_000, completion_tokens=500), 200)
        await limiter._flush()
        level = float(await client.hget(redis_keys.rate_limit(key.id), "t"))
    finally:
        await client.aclose()
    assert grant.charged_tokens == tpm
    assert level <= -tpm + 1  # 30,500 used from 10,000: the debt's floor (a two-minute wait)


async def test_one_timed_out_call_does_not_give_a_gateway_a_second_minute(redis_url, redis_keys) -> None:
    """The fallback's local buckets started full, knowing nothing of what the shared bucket had
    admitted: a 10/min key spent through Redis, then one call that timed out, and the same gateway
    admitted 10 more within a second (one gateway, twice the limit)."""
    from redis.exceptions import TimeoutError as RedisTimeout

    from routing.frontdoor.ratelimit import RateLimiter

    rpm = 10
    client = make_limiter_redis(redis_url, 1.0)
    limiter = RateLimiter(client, redis_keys, lease_fraction=0.01)  # under 100/min: no lease
    key = make_key("gorgo-sk-k1-blip-secret", requests_per_min=rpm)
    evalsha = client.evalsha
    fail_next = [False]

    async def flaky(*args: object) -> object:
        if fail_next[0]:
            fail_next[0] = False
            raise RedisTimeout("Timeout reading from socket")  # one slow answer
        return await evalsha(*args)

    client.evalsha = flaky  # type: ignore[method-assign]
    admitted = 0
    try:
        for _ in range(rpm + 5):  # the minute's allowance through Redis, then refusals
            admitted += (await limiter.check(key, 1)).allowed
        assert admitted == rpm
        fail_next[0] = True
        for _ in range(rpm + 5):  # answered locally for the backoff's second
            admitted += (await limiter.check(key, 1)).allowed
    finally:
        await client.aclose()
    assert limiter.fallbacks > 0 and admitted <= rpm + 1  # a second's refill at most


async def test_a_stream_the_client_cuts_midway_keeps_its_token_charge(
    aredis, redis_keys, redis_url, stubs
) -> None:
    """A client that reads a stream and hangs up before its usage event (status 499) had its whole
    token charge given back, as for a request no node served: read every answer but its last
    event, and a tokens/min limit cost nothing, prompt included."""
    await setup(aredis, redis_keys, stubs, tokens_per_min=1000)
    body = {
        **BODY,
        "messages": [{"role": "user", "content": "x" * 2000}],  # ~500 tokens estimated
        "stream": True,
        "stream_options": {"include_usage": True},
        "stub": {"chunks": 100, "chunk_delay_s": 0.05},
    }
    async with running_gateway(gateway_config(redis_keys, redis_url, auth="on")) as gateway:
        async with gateway.http.stream("POST", "/v1/chat/completions", json=body, headers=AUTH) as answer:
            assert answer.status_code == 200
            charged_to = int(answer.headers["x-ratelimit-remaining-tokens"])
            async for line in answer.aiter_lines():
                if line.startswith("data:"):
                    break  # the node is generating; the client hangs up
        await wait_for(lambda: aredis.xlen(redis_keys.request_stream))  # done() has run
        front_door = gateway.app.runtime.front_door
        assert front_door is not None
        await front_door.limiter._flush()  # the settle loop, at once
        level = float(await aredis.hget(redis_keys.rate_limit("k1"), "t"))
    assert charged_to < 600
    assert level < charged_to + 100, level  # a few seconds' refill, not the ~500 given back


async def test_a_client_that_hangs_up_before_the_first_token_keeps_its_prompt_charge(
    aredis, redis_keys, redis_url, stubs
) -> None:
    """A client that sent a long prompt and hung up while the node was still on it (no answer
    yet: status 499) was given its whole charge back, as for a request no node took: the node
    prefilled the prompt, and a tokens/min limit never counted it. A request the gateway refused
    before any node saw it still costs nothing."""
    await setup(aredis, redis_keys, stubs, tokens_per_min=1000)
    body = {
        **BODY,
        "messages": [{"role": "user", "content": "x" * 2000}],  # ~500 tokens estimated
        "stub": {"delay_s": 1.0},  # the node is busy with it (the client leaves well before)
    }
    async with running_gateway(gateway_config(redis_keys, redis_url, auth="on")) as gateway:
        front_door = gateway.app.runtime.front_door
        assert front_door is not None
        call = asyncio.create_task(gateway.http.post("/v1/chat/completions", json=body, headers=AUTH))
        await wait_for(lambda: stubs[0].seen)  # the node has it
        call.cancel()  # the client hangs up before any answer
        with contextlib.suppress(asyncio.CancelledError):
            await call
        await wait_for(lambda: aredis.xlen(redis_keys.request_stream))  # done() has run
        (_, fields), *_ = await aredis.xrange(redis_keys.request_stream)
        await front_door.limiter._flush()  # the settle loop, at once
        level = float(await aredis.hget(redis_keys.rate_limit("k1"), "t"))
    assert decode(fields[b"r"], RequestRecord).status == 499
    assert level < 1000 - 400, level  # the ~500 prompt tokens stay charged (less a little refill)


async def test_a_stream_without_a_usage_event_is_charged_its_completion(
    aredis, redis_keys, redis_url, stubs
) -> None:
    """A stream without ``stream_options.include_usage`` (OpenAI's SDKs stream without it unless
    asked) has no usage event, and its charge stayed the prompt estimate: every token it generated
    was free, so a tokens/min limit held streaming clients to their prompts only."""
    await setup(aredis, redis_keys, stubs, tokens_per_min=1000)
    body = {**BODY, "stream": True, "stub": {"chunks": 300}}  # a 3-token prompt, 300 tokens out
    async with running_gateway(gateway_config(redis_keys, redis_url, auth="on")) as gateway:
        answer = await gateway.http.post("/v1/chat/completions", json=body, headers=AUTH)
        assert answer.status_code == 200 and answer.text.count("data: {") == 300
        await wait_for(lambda: aredis.xlen(redis_keys.request_stream))  # done() has run
        front_door = gateway.app.runtime.front_door
        assert front_door is not None
        await front_door.limiter._flush()  # the settle loop, at once
        level = float(await aredis.hget(redis_keys.rate_limit("k1"), "t"))
    assert level < 1000 - 250, level  # the 300 tokens streamed are charged (less a few seconds' refill)
