"""Per-node circuit breakers and the retry budget: pure bookkeeping, clock passed in."""

from __future__ import annotations

from routing.resilience.breaker import HALF_OPEN, OPEN, Breakers, RetryBudget


class TestBreakers:
    def test_soft_failures_open_it_only_when_consecutive(self):
        breakers = Breakers(failure_threshold=3, open_s=5.0)
        breakers.failure(1, 0.0, hard=False)
        breakers.failure(1, 0.0, hard=False)
        breakers.success(1)
        breakers.failure(1, 0.0, hard=False)
        breakers.failure(1, 0.0, hard=False)
        assert breakers.blocked == frozenset()
        breakers.failure(1, 0.0, hard=False)
        assert breakers.blocked == {1}
        assert breakers.states() == {1: OPEN}

    def test_a_hard_failure_opens_it_until_a_probe_succeeds(self):
        breakers = Breakers(open_s=5.0)
        breakers.failure(7, 10.0, hard=True)
        assert breakers.blocked == {7}
        assert breakers.next_probe_in_s(14.0) == 1.0
        assert breakers.due_probes(14.9) == []
        assert breakers.due_probes(15.0) == [7]
        assert breakers.states() == {7: HALF_OPEN} and breakers.blocked == {7}
        assert breakers.due_probes(15.1) == []  # one probe at a time
        breakers.success(7)
        assert breakers.blocked == frozenset() and breakers.states() == {}

    def test_a_failed_probe_waits_twice_as_long_up_to_the_maximum(self):
        breakers = Breakers(open_s=5.0, max_open_s=12.0)
        breakers.failure(2, 0.0, hard=True)
        for now, open_s in ((5.0, 10.0), (15.0, 12.0), (27.0, 12.0)):
            assert breakers.due_probes(now) == [2]
            breakers.failure(2, now, hard=True)
            assert breakers.due_probes(now + open_s - 0.01) == []
            assert breakers.blocked == {2}


class TestRetryBudget:
    def test_retries_stay_within_ten_percent_of_requests_after_the_reserve(self):
        budget = RetryBudget(ratio=0.1, reserve=2.0)
        retries = 0
        for _ in range(1000):
            budget.deposit()
            retries += budget.spend()
        assert 99 <= retries <= 102


class TestBreakersInTheGateway:
    async def test_a_fleet_of_failed_nodes_gets_503_with_retry_after_not_more_traffic(
        self, aredis, redis_keys, redis_url
    ):
        from tests.conftest import free_port
        from tests.routing.support import (
            MODEL,
            gateway_config,
            make_node,
            make_snapshot,
            publish,
            running_gateway,
        )

        dead = make_node(1, f"http://127.0.0.1:{free_port()}", name="dead")
        await publish(aredis, redis_keys, make_snapshot((dead,)))
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
        config = gateway_config(redis_keys, redis_url, node_down_cooldown_s=30)
        async with running_gateway(config) as gateway:
            first = await gateway.http.post("/v1/chat/completions", json=body)
            then = [await gateway.http.post("/v1/chat/completions", json=body) for _ in range(3)]
            metrics = (await gateway.http.get("/metrics")).text
        assert first.status_code == 502
        assert {answer.status_code for answer in then} == {503}
        assert int(then[0].headers["retry-after"]) > 1
        assert 'gorgo_gateway_breaker_state{node="dead"} 2.0' in metrics
        assert 'gorgo_gateway_upstream_errors_total{kind="connect",node="dead"} 1.0' in metrics
