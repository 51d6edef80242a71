"""Live node state older than ``GORGO_LIVE_STALE_S`` is ignored: the node counts as unmeasured."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
import redis.exceptions

from routing.algorithms import REGISTRY, gorgo
from routing.algorithms.base import NodeLoad, RoutingRequest, RoutingView
from routing.config import GatewayConfig
from routing.contract import SCHEMA_VERSION, GorgoParams, NodeLiveState, encode
from routing.state.policy_store import PolicyStore, make_redis
from tests.routing.support import make_node, make_snapshot, publish

MODEL_NAME = "meta-llama/Llama-3.1-8B-Instruct"


class Clock:
    """Unix seconds the test moves by hand."""

    def __init__(self) -> None:
        self.now_s = time.time()

    def __call__(self) -> float:
        return self.now_s


async def write_live(aredis, keys, node_id: int, *, healthy: bool, updated_at: float) -> None:
    state = NodeLiveState(SCHEMA_VERSION, node_id, healthy, updated_at, num_running=7.0)
    await aredis.hset(keys.live_nodes, str(node_id), encode(state))


def candidate_ids(store: PolicyStore) -> list[int]:
    assert store.table is not None
    return [node.id for node in store.table.candidates[MODEL_NAME]]


_opened: list[PolicyStore] = []


@pytest.fixture(autouse=True)
async def _close_stores() -> AsyncIterator[None]:
    yield
    while _opened:
        await _opened.pop()._redis.aclose()


async def loaded_store(aredis, redis_keys, redis_url, clock: Clock, **options) -> PolicyStore:
    """A policy store over two nodes, loaded once (its background tasks are not started)."""
    await publish(aredis, redis_keys, make_snapshot((make_node(1), make_node(2))))
    store = PolicyStore(make_redis(redis_url), redis_keys, "us-east", REGISTRY, clock=clock, **options)
    _opened.append(store)
    await store.refresh_live()
    assert await store.reload_policy()
    return store


class TestLiveStaleness:
    async def test_it_excludes_a_node_marked_unhealthy_recently(self, aredis, redis_keys, redis_url):
        clock = Clock()
        await write_live(aredis, redis_keys, 1, healthy=False, updated_at=clock.now_s - 5)
        store = await loaded_store(aredis, redis_keys, redis_url, clock, live_stale_s=30.0)
        assert candidate_ids(store) == [2]
        assert store.table is not None and 1 in store.table.live

    async def test_an_unhealthy_mark_stamped_in_the_future_ages_from_when_it_was_read(
        self, aredis, redis_keys, redis_url
    ):
        """A telemetry worker whose clock runs an hour ahead stamps its entries an hour in the
        gateway's future: when it stopped, its "unhealthy" mark excluded the node for that hour.
        An entry now also ages from when the gateway first read its stamp."""
        clock = Clock()
        await write_live(aredis, redis_keys, 1, healthy=False, updated_at=clock.now_s + 3600)
        store = await loaded_store(aredis, redis_keys, redis_url, clock, live_stale_s=30.0)
        assert candidate_ids(store) == [2]
        clock.now_s += 20
        await store.refresh_live()
        assert candidate_ids(store) == [2]  # within the limit of when it was read
        clock.now_s += 11  # 31 s since that stamp arrived, and it never changed: the worker stopped
        await store.refresh_live()
        assert candidate_ids(store) == [1, 2]
        assert store.table is not None and 1 not in store.table.live
        await write_live(aredis, redis_keys, 1, healthy=False, updated_at=clock.now_s + 3601)
        await store.refresh_live()  # it writes again: a new stamp is fresh
        assert candidate_ids(store) == [2]

    async def test_load_figures_of_a_scrape_that_stopped_are_unknown_while_probes_go_on(
        self, aredis, redis_keys, redis_url
    ):
        """The probes refresh a node's entry (``updated_at``) every few seconds; its load figures
        come from the scrape. When the scrape stopped (the node's /metrics broke), the entry stayed
        fresh and its last load (7 running, 3 waiting) was read as current for as long as the
        probes went on. Past ``live_stale_s`` since the scrape it is now unknown; health stays."""
        clock = Clock()

        async def write(scraped_at: float) -> None:
            state = NodeLiveState(
                SCHEMA_VERSION,
                1,
                True,
                clock.now_s - 1,  # a probe a second ago
                num_running=7.0,
                num_waiting=3.0,
                kv_cache_usage=0.9,
                last_scrape_at=scraped_at,
                last_probe_at=clock.now_s - 1,
            )
            await aredis.hset(redis_keys.live_nodes, "1", encode(state))

        await write(scraped_at=clock.now_s - 5)
        store = await loaded_store(aredis, redis_keys, redis_url, clock, live_stale_s=30.0)
        assert store.table is not None and store.table.live[1].num_running == 7.0
        clock.now_s += 40
        await write(scraped_at=clock.now_s - 45)  # probed since, not scraped for 45 s
        await store.refresh_live()
        state = store.table.live[1]
        assert state.healthy and state.num_running is None and state.num_waiting is None
        assert state.kv_cache_usage is None
        await write(scraped_at=clock.now_s - 1)  # the scrape is back
        await store.refresh_live()
        assert store.table.live[1].num_running == 7.0

    async def test_it_ignores_an_unhealthy_mark_once_it_is_older_than_the_limit(
        self, aredis, redis_keys, redis_url
    ):
        clock = Clock()
        await write_live(aredis, redis_keys, 1, healthy=False, updated_at=clock.now_s - 5)
        store = await loaded_store(aredis, redis_keys, redis_url, clock, live_stale_s=30.0)
        assert candidate_ids(store) == [2]
        clock.now_s += 26  # the workers stopped writing 31 s ago
        await store.refresh_live()
        assert candidate_ids(store) == [1, 2]
        assert store.table is not None and 1 not in store.table.live  # unknown, not "healthy"

    async def test_it_does_not_trust_a_stale_healthy_entry_either(self, aredis, redis_keys, redis_url):
        clock = Clock()
        await write_live(aredis, redis_keys, 2, healthy=True, updated_at=clock.now_s - 60)
        store = await loaded_store(aredis, redis_keys, redis_url, clock, live_stale_s=30.0)
        # Its scraped load (num_running=7) would steer gorgo; a minute-old scrape must not.
        assert store.table is not None and store.table.live == {}

    async def test_it_ages_entries_out_while_redis_is_unreachable(self, aredis, redis_keys, redis_url):
        clock = Clock()
        await write_live(aredis, redis_keys, 1, healthy=False, updated_at=clock.now_s)
        store = await loaded_store(aredis, redis_keys, redis_url, clock, live_stale_s=30.0)
        assert candidate_ids(store) == [2]
        await store._redis.aclose()
        store._redis = make_redis("redis://127.0.0.1:1/0")  # nothing listens there
        clock.now_s += 31
        try:
            await store.refresh_live()
        except (redis.exceptions.RedisError, OSError):
            store.expire_live()  # what the periodic task does when a refresh fails
        assert candidate_ids(store) == [1, 2]

    def test_it_reads_the_limit_from_the_environment(self):
        assert GatewayConfig.from_env({"GORGO_REGION": "us-east"}).live_stale_s == 30.0
        config = GatewayConfig.from_env({"GORGO_REGION": "us-east", "GORGO_LIVE_STALE_S": "12.5"})
        assert config.live_stale_s == 12.5


class TestImpossibleLiveFigures:
    async def test_a_scraped_count_no_engine_has_is_dropped_and_the_health_kept(
        self, aredis, redis_keys, redis_url
    ):
        """A node's /metrics saying 1e308 requests running (a broken or hostile endpoint; the scrape
        drops only NaN and infinities) reached gorgo, whose queue term overflowed to inf and whose
        displacement then took 0 * inf = NaN: every decision over the model raised IndexError (no
        candidate's cost compared). The figure is now unknown, as a failed scrape's; the entry's
        health still counts, and so does a plausible figure beside it."""
        clock = Clock()
        await publish(
            aredis,
            redis_keys,
            make_snapshot(
                (make_node(1, region="eu-central"), make_node(2, region="eu-central"), make_node(3)),
                params=GorgoParams(),
            ),
        )
        for node_id, healthy, running in ((1, True, 1e308), (2, True, 7.0), (3, False, -4.0)):
            state = NodeLiveState(SCHEMA_VERSION, node_id, healthy, clock.now_s, num_running=running)
            await aredis.hset(redis_keys.live_nodes, str(node_id), encode(state))
        store = PolicyStore(make_redis(redis_url), redis_keys, "us-east", REGISTRY, clock=clock)
        _opened.append(store)
        await store.refresh_live()
        assert await store.reload_policy()
        table = store.table
        assert table is not None
        assert candidate_ids(store) == [1, 2]  # node 3's unhealthy mark stands
        assert table.live[1].num_running is None and table.live[2].num_running == 7.0
        assert table.live[3].num_running is None

        # node 1 alone (node 2 failed here), with requests of eu-central's own outstanding on it
        view = RoutingView(
            table.region,
            table.candidates[MODEL_NAME][:1],
            table.params,
            {1: NodeLoad(1, 0, 1)},
            live=table.live,
        )
        assert gorgo.choose(view, RoutingRequest(MODEL_NAME, 400_000, 100_000)).node.id == 1
