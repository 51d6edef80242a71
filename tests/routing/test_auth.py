"""Client keys at the gateway: 401/403 in OpenAI's shape, key sets swapped live, nothing leaked.

Repro of issue 12: 300 rapid requests without any key were all served.
"""

from __future__ import annotations

import time

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

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
SECRET = "gorgo-sk-k1-test-secret-0123456789abcdef"
OTHER = "Qwen/Qwen2.5-7B-Instruct"


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def setup(aredis, redis_keys, stubs, *specs):
    node = make_node(1, stubs[0].url, models=(MODEL, OTHER))
    await publish(aredis, redis_keys, make_snapshot((node,)))
    await publish_keys(aredis, redis_keys, *specs)


class TestAuth:
    async def test_it_refuses_requests_without_a_key(self, aredis, redis_keys, redis_url, stubs):
        await setup(aredis, redis_keys, stubs, make_key(SECRET))
        async with running_gateway(gateway_config(redis_keys, redis_url, auth="on")) as gateway:
            answers = [await gateway.http.post("/v1/chat/completions", json=BODY) for _ in range(20)]
            metrics = (await gateway.http.get("/metrics")).text
        assert {answer.status_code for answer in answers} == {401}
        error = answers[0].json()["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "AuthenticationError"
        assert stubs[0].seen == []
        assert 'gorgo_gateway_auth_failures_total{reason="missing"} 20.0' in metrics

    async def test_it_serves_a_valid_key_by_either_header_and_never_forwards_it(
        self, aredis, redis_keys, redis_url, stubs
    ):
        await setup(aredis, redis_keys, stubs, make_key(SECRET))
        async with running_gateway(gateway_config(redis_keys, redis_url, auth="on")) as gateway:
            by_bearer = await gateway.http.post("/v1/chat/completions", json=BODY, headers=bearer(SECRET))
            by_api_key = await gateway.http.post(
                "/v1/chat/completions", json=BODY, headers={"api-key": SECRET}
            )
            wrong = await gateway.http.post("/v1/chat/completions", json=BODY, headers=bearer(SECRET + "x"))
            metrics = (await gateway.http.get("/metrics")).text
        assert (by_bearer.status_code, by_api_key.status_code, wrong.status_code) == (200, 200, 401)
        assert all(
            "authorization" not in seen.headers and "api-key" not in seen.headers for seen in stubs[0].seen
        )
        assert (
            'gorgo_gateway_key_requests_total{key_id="k1",priority="interactive",status_class="2xx"} 2.0'
            in metrics
        )
        assert 'gorgo_gateway_auth_failures_total{reason="invalid"} 1.0' in metrics

    async def test_it_refuses_revoked_and_expired_keys(self, aredis, redis_keys, redis_url, stubs):
        await setup(
            aredis,
            redis_keys,
            stubs,
            make_key(SECRET, revoked=True),
            make_key("gorgo-sk-k2-old", key_id="k2", expires_at=time.time() - 1),
        )
        async with running_gateway(gateway_config(redis_keys, redis_url, auth="on")) as gateway:
            revoked = await gateway.http.post("/v1/chat/completions", json=BODY, headers=bearer(SECRET))
            expired = await gateway.http.post(
                "/v1/chat/completions", json=BODY, headers=bearer("gorgo-sk-k2-old")
            )
        assert revoked.status_code == expired.status_code == 401
        assert "revoked" in revoked.json()["error"]["message"]
        assert "expired" in expired.json()["error"]["message"]

    async def test_it_limits_keys_to_their_models_and_regions(self, aredis, redis_keys, redis_url, stubs):
        await setup(
            aredis,
            redis_keys,
            stubs,
            make_key(SECRET, models=(MODEL,)),
            make_key("gorgo-sk-k2-eu", key_id="k2", regions=("eu-central",)),
        )
        async with running_gateway(gateway_config(redis_keys, redis_url, auth="on")) as gateway:
            allowed = await gateway.http.post("/v1/chat/completions", json=BODY, headers=bearer(SECRET))
            other_model = await gateway.http.post(
                "/v1/chat/completions", json={**BODY, "model": OTHER}, headers=bearer(SECRET)
            )
            other_region = await gateway.http.post(
                "/v1/chat/completions", json=BODY, headers=bearer("gorgo-sk-k2-eu")
            )
        assert allowed.status_code == 200
        assert other_model.status_code == 403 and other_model.json()["error"]["param"] == "model"
        assert other_region.status_code == 403
        assert other_region.json()["error"]["code"] == "region_not_allowed"

    async def test_a_revocation_reaches_the_gateway_within_a_second(
        self, aredis, redis_keys, redis_url, stubs
    ):
        await setup(aredis, redis_keys, stubs, make_key(SECRET))
        async with running_gateway(gateway_config(redis_keys, redis_url, auth="on")) as gateway:
            assert (
                await gateway.http.post("/v1/chat/completions", json=BODY, headers=bearer(SECRET))
            ).is_success
            await publish_keys(aredis, redis_keys, make_key(SECRET, revoked=True))

            async def refused() -> bool:
                answer = await gateway.http.post("/v1/chat/completions", json=BODY, headers=bearer(SECRET))
                return answer.status_code == 401

            await wait_for(refused, timeout_s=1.0)

    async def test_it_keeps_the_last_key_set_over_an_older_or_broken_one(
        self, aredis, redis_keys, redis_url, stubs
    ):
        await setup(aredis, redis_keys, stubs, make_key(SECRET))
        async with running_gateway(gateway_config(redis_keys, redis_url, auth="on")) as gateway:
            store = gateway.app.runtime.front_door.store
            version = store.version
            await aredis.set(redis_keys.key_set, b"{not json")
            await aredis.publish(redis_keys.key_channel, b"x")
            await gateway.http.get("/healthz")
            assert not await store.reload()
            answer = await gateway.http.post("/v1/chat/completions", json=BODY, headers=bearer(SECRET))
        assert answer.status_code == 200 and store.version == version

    async def test_it_records_the_key_and_its_last_use(self, aredis, redis_keys, redis_url, stubs):
        await setup(aredis, redis_keys, stubs, make_key(SECRET, priority="batch"))
        config = gateway_config(redis_keys, redis_url, auth="on", key_refresh_s=0.1)
        async with running_gateway(config) as gateway:
            await gateway.http.post("/v1/chat/completions", json=BODY, headers=bearer(SECRET))
            await wait_for(lambda: aredis.hexists(redis_keys.key_last_used, "k1"))
            await wait_for(lambda: aredis.xlen(redis_keys.request_stream))
        from routing.contract import RequestRecord, decode

        entries = await aredis.xrange(redis_keys.request_stream)
        record = decode(entries[0][1][b"r"], RequestRecord)
        assert (record.key_id, record.priority) == ("k1", "batch")
        assert SECRET.encode() not in entries[0][1][b"r"]


class TestRefusedAttemptsPerKey:
    """Issue 22, item 10: after revoking a leaked key an operator could not see it still being
    tried: its 401s carried no key id (usage said "Refused 0"), the only metric had none either."""

    async def test_a_revoked_or_expired_key_is_recorded_and_counted_for_its_key(
        self, aredis, redis_keys, redis_url, stubs
    ):
        from routing.contract import RequestRecord, decode

        expired_secret = "gorgo-sk-k2-expired-secret-abcdef"
        await setup(
            aredis,
            redis_keys,
            stubs,
            make_key(SECRET, revoked=True, priority="batch"),
            make_key(expired_secret, key_id="k2", expires_at=time.time() - 60),
        )
        async with running_gateway(gateway_config(redis_keys, redis_url, auth="on")) as gateway:
            for secret in (SECRET, SECRET, SECRET, expired_secret):
                answer = await gateway.http.post("/v1/chat/completions", json=BODY, headers=bearer(secret))
                assert answer.status_code == 401
            # Made-up keys, one of them naming the revoked key's id: attributed to no one.
            for index in range(50):
                await gateway.http.post(
                    "/v1/chat/completions", json=BODY, headers=bearer(f"gorgo-sk-k{index}-made-up")
                )
            metrics = (await gateway.http.get("/metrics")).text
            await wait_for(lambda: gateway.app.runtime.request_log.pending == 0)
            await wait_for(lambda: aredis.xlen(redis_keys.request_stream))
        records = [
            decode(fields[b"r"], RequestRecord)
            for _, fields in await aredis.xrange(redis_keys.request_stream)
        ]
        refused = [(r.key_id, r.priority, r.status) for r in records if r.key_id is not None]
        assert sorted(refused) == [("k1", "batch", 401)] * 3 + [("k2", "interactive", 401)]
        assert sum(1 for r in records if r.key_id is None and r.status == 401) == 50
        assert (
            'gorgo_gateway_key_requests_total{key_id="k1",priority="batch",status_class="4xx"} 3.0' in metrics
        )
        assert 'key_id="k2",priority="interactive",status_class="4xx"} 1.0' in metrics
        # Nothing grows per made-up id: only the key set's ids ever label a series.
        assert not any(f'key_id="k{index}"' in metrics for index in (0, *range(3, 50)))


class TestDemoTraffic:
    async def test_the_traffic_generator_sends_its_key(self, aredis, redis_keys, redis_url, stubs):
        from simulator.traffic import build_plan, run_plan

        await setup(aredis, redis_keys, stubs, make_key(SECRET))
        plan = build_plan(
            "hot-prefix", ["us-east"], rate_rps=50, duration_s=0.2, max_requests=5, seed=1, max_tokens=2
        )
        async with running_gateway(gateway_config(redis_keys, redis_url, auth="on")) as gateway:
            with_key = await run_plan(plan, {"us-east": gateway.url}, model=MODEL, api_key=SECRET)
            without = await run_plan(plan, {"us-east": gateway.url}, model=MODEL)
        assert with_key and all(result.ok for result in with_key)
        assert without and not any(result.ok for result in without)


class TestKnownCredentials:
    """The front door remembers credentials it accepted; that must never outlive a key's rights."""

    @staticmethod
    def door(*specs, clock=time.time):
        from redis.asyncio import Redis

        from routing.contract import RedisKeys
        from routing.frontdoor.concurrency import ConcurrencyLimiter
        from routing.frontdoor.front_door import FrontDoor
        from routing.frontdoor.keystore import KeyStore
        from routing.frontdoor.ratelimit import RateLimiter
        from routing.observability.exporter import GatewayMetrics

        client = Redis()  # never connected: nothing here talks to Redis
        store = KeyStore(client, RedisKeys(prefix="unused"))
        store.by_hash = {spec.secret_sha256: spec for spec in specs}
        unused = RedisKeys(prefix="unused")
        return FrontDoor(
            "local",
            store,
            RateLimiter(client, unused),
            ConcurrencyLimiter(client, unused, "gw-test"),
            GatewayMetrics(),
            clock=clock,
        )

    @staticmethod
    def headers(secret: str):
        from routing.http.headers import scan_request_headers

        return scan_request_headers(
            [(b"authorization", f"Bearer {secret}".encode())], None, keep_credentials=False
        )

    def test_an_accepted_key_is_refused_once_it_expires(self):
        import pytest

        from routing.frontdoor.auth import AuthError

        now_s = [1_000_000.0]
        door = self.door(make_key(SECRET, expires_at=now_s[0] + 0.2), clock=lambda: now_s[0])
        assert door.authenticate(self.headers(SECRET)).id == "k1"
        now_s[0] += 0.25
        with pytest.raises(AuthError) as refused:
            door.authenticate(self.headers(SECRET))
        assert refused.value.reason == "expired"

    def test_a_new_key_set_forgets_what_the_old_one_accepted(self):
        import pytest

        from routing.frontdoor.auth import AuthError

        door = self.door(make_key(SECRET))
        assert door.authenticate(self.headers(SECRET)).id == "k1"
        door.store.by_hash = {make_key(SECRET, revoked=True).secret_sha256: make_key(SECRET, revoked=True)}
        with pytest.raises(AuthError) as refused:
            door.authenticate(self.headers(SECRET))
        assert refused.value.reason == "revoked"

    def test_refused_credentials_are_not_remembered(self):
        import pytest

        from routing.frontdoor.auth import AuthError

        door = self.door(make_key(SECRET))
        for index in range(100):
            with pytest.raises(AuthError):
                door.authenticate(self.headers(f"gorgo-sk-guess-{index}"))
        assert door._known == {}

    def test_padded_credentials_do_not_grow_what_is_remembered(self):
        """Accepted credentials are remembered by their header values, up to 10,000 of them; a
        client with one valid key could send it with a different 60 kB ``api-key`` beside it (or
        padded with spaces after ``Bearer``), and each value was kept whole: 10,000 of them held
        600 MB of the gateway's memory."""
        from routing.http.headers import scan_request_headers

        door = self.door(make_key(SECRET))
        for index in range(200):
            padding = b" " * (60_000 + index)
            for raw in (
                [(b"authorization", f"Bearer {SECRET}".encode()), (b"api-key", b"x" + padding + b"x")],
                [(b"authorization", b"Bearer" + padding + SECRET.encode())],
            ):
                headers = scan_request_headers(raw, None, keep_credentials=False)
                assert door.authenticate(headers).id == "k1"
        held = sum(len(authorization or b"") + len(api_key or b"") for authorization, api_key in door._known)
        assert held <= 400 * 1024, held  # a few hundred bytes a credential at most
