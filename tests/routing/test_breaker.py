"""Per-node circuit breakers and the retry budget: pure bookkeeping, clock passed in."""

from __future__ import annotations

from routing.contract import SCHEMA_VERSION, NodeLiveState
from routing.http.upstream import UpstreamClient
from routing.resilience.breaker import HALF_OPEN, OPEN, Breakers, RetryBudget
from routing.resilience.node_probe import NodeProber
from tests.conftest import free_port
from tests.routing.support import (
    MODEL,
    gateway_config,
    make_node,
    make_snapshot,
    publish,
    publish_live,
    running_gateway,
)
from tests.support.vllm_stub import StubNode
from tests.support.waiting import wait_for


def live(node_id: int, healthy: bool) -> NodeLiveState:
    return NodeLiveState(SCHEMA_VERSION, node_id, healthy, 0.0)


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

    def test_a_node_telemetry_saw_come_back_is_probed_at_once(self):
        breakers = Breakers(open_s=30.0)
        breakers.failure(3, 0.0, hard=True)
        breakers.recovered(3, 2.0)
        assert breakers.due_probes(2.0) == [3]  # not at 30 s
        breakers.recovered(3, 2.5)  # half-open: its probe is under way, nothing to hurry
        assert breakers.states() == {3: HALF_OPEN}
        breakers.recovered(4, 2.5)  # never failed here: nothing to do
        assert breakers.states() == {3: HALF_OPEN}


class TestProberFollowsTelemetry:
    """A node the live state saw go down and come back: its open breaker waited up to
    ``breaker_max_open_s`` (60 s) for its next probe (region-outage: the gateways kept their
    region's clients abroad ~2.4 s after its nodes came back)."""

    def prober(self, breakers: Breakers) -> NodeProber:
        # Following the live state sends nothing; compiled, the client's type is still checked.
        client = UpstreamClient(connect_timeout_s=1.0, read_timeout_s=1.0, keepalive_s=60.0)
        return NodeProber(breakers, client, lambda: None)

    async def test_it_probes_a_node_telemetry_saw_go_down_and_come_back(self):
        breakers = Breakers(open_s=30.0)
        prober = self.prober(breakers)
        breakers.failure(1, 0.0, hard=True)
        prober.follow_live({1: live(1, True)}, 1.0)  # healthy since before it failed here: no news
        assert breakers.due_probes(1.0) == []
        prober.follow_live({1: live(1, False)}, 2.0)
        assert breakers.due_probes(2.0) == [] and prober.down_in_telemetry == {1}
        prober.follow_live({1: live(1, True)}, 3.0)
        assert breakers.due_probes(3.0) == [1]
        assert prober.down_in_telemetry == set()

    async def test_a_steady_healthy_entry_does_not_hurry_a_failing_nodes_probes(self):
        breakers = Breakers(open_s=5.0)
        prober = self.prober(breakers)
        breakers.failure(1, 0.0, hard=True)
        for now in (1.0, 2.0, 3.0):
            prober.follow_live({1: live(1, True)}, now)
            assert breakers.due_probes(now) == []

    async def test_it_hurries_each_comeback_once_and_remembers_a_node_whose_entry_went_stale(self):
        breakers = Breakers(open_s=30.0)
        prober = self.prober(breakers)
        breakers.failure(1, 0.0, hard=True)
        prober.follow_live({1: live(1, False), 2: live(2, True)}, 1.0)
        prober.follow_live({2: live(2, True)}, 2.0)  # node 1's entry went stale: still down
        prober.follow_live({1: live(1, True), 2: live(2, True)}, 3.0)
        assert breakers.due_probes(3.0) == [1]
        breakers.failure(1, 3.0, hard=True)  # its probe failed: 60 s now
        prober.follow_live({1: live(1, True), 2: live(2, True)}, 4.0)  # the same news again
        assert breakers.due_probes(4.0) == []


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

    async def test_a_node_telemetry_saw_come_back_gets_requests_before_its_breaker_wait_is_over(
        self, aredis, redis_keys, redis_url
    ):

        port = free_port()
        node = make_node(1, f"http://127.0.0.1:{port}", name="back")
        await publish(aredis, redis_keys, make_snapshot((node,)))
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
        # A minute before the breaker's own probe: the node must come back through telemetry.
        config = gateway_config(redis_keys, redis_url, node_down_cooldown_s=60)
        async with running_gateway(config) as gateway:
            assert (await gateway.http.post("/v1/chat/completions", json=body)).status_code == 502
            await publish_live(aredis, redis_keys, healthy={1: False})
            prober = gateway.app.runtime.prober
            await wait_for(lambda: prober.down_in_telemetry == {1}, what="the prober saw it down")
            stub = StubNode(name="back", port=port)
            await stub.start()
            try:
                await publish_live(aredis, redis_keys, healthy={1: True})

                async def answered() -> bool:
                    answer = await gateway.http.post("/v1/chat/completions", json=body)
                    return answer.status_code == 200

                await wait_for(answered, timeout_s=20.0, interval_s=0.1, what="a request answered")
            finally:
                await stub.stop()
