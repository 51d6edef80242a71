"""Shadow and canary on a running gateway (issue 23): the record carries the shadow's decision; a
canary serves the sessions its hash picks, a conversation stays on one side; a trial the gateway
cannot load leaves the live policy serving."""

from __future__ import annotations

import msgspec

from routing.algorithms import REGISTRY
from routing.contract import (
    GorgoParams,
    PolicySpec,
    RequestRecord,
    ResidencyRule,
    RoundRobinParams,
    TrialSpec,
    decode,
)
from routing.state.trials import TrialRoute, in_canary, load_trial
from tests.routing.support import (
    MODEL,
    gateway_config,
    make_node,
    make_snapshot,
    publish,
    publish_live,
    running_gateway,
    wait_for,
)

# ~1,000 prompt tokens: 100 ms of prefill on gpu-a, 20 ms on the faster gpu-b.
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "route me " * 450}]}


def fresh(index: int) -> dict:
    """A prompt no node has cached (the prefix index would credit gpu-a with the last one)."""
    return {"model": MODEL, "messages": [{"role": "user", "content": f"{index} " + "route me " * 450}]}


def two_regions(stubs):
    return (
        make_node(1, stubs[0].url, name="gpu-a", region="us-east"),
        make_node(2, stubs[1].url, name="gpu-b", region="eu-central", prefill_tokens_per_s=50_000.0),
    )


def trial(
    kind: str, params, *, trial_id: int = 7, share: float = 0.0, residency=(), salt: str = "s4lt"
) -> TrialSpec:
    algorithm = type(params).__struct_config__.tag
    policy = PolicySpec(id=2, name="candidate", algorithm=algorithm, params=params, residency=residency)
    return TrialSpec(id=trial_id, kind=kind, policy=policy, share=share, salt=salt)


async def records(aredis, redis_keys, count: int) -> list[RequestRecord]:
    """The request log once it holds ``count`` records (the gateway flushes it every 10 ms)."""
    entries: list = []

    async def enough() -> bool:
        entries[:] = await aredis.xrange(redis_keys.request_stream)
        return len(entries) >= count

    await wait_for(enough, what=f"{count} request records")
    return [decode(fields[b"r"], RequestRecord) for _, fields in entries]


def canary_route(snapshot) -> TrialRoute:
    route = load_trial(snapshot.canary, snapshot, "us-east", REGISTRY, {}, {})
    assert route is not None
    return route


class TestShadow:
    async def test_it_logs_where_the_shadow_would_have_sent_each_request(
        self, aredis, redis_keys, redis_url, stubs
    ):
        shadow = trial("shadow", GorgoParams(w_rtt=0.0))  # blind to the 150 ms to eu-central
        snapshot = make_snapshot(two_regions(stubs), params=GorgoParams(), shadow=shadow)
        await publish(aredis, redis_keys, snapshot)
        await publish_live(aredis, redis_keys, rtt_ms={("us-east", 1): 1.0, ("us-east", 2): 150.0})
        async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
            await wait_for(
                lambda: gateway.app.runtime.store.table is not None and gateway.app.runtime.store.table.rtt_ms
            )
            answers = [await gateway.http.post("/v1/chat/completions", json=fresh(i)) for i in range(3)]
        assert [a.headers["x-gorgo-node"] for a in answers] == ["gpu-a"] * 3  # the shadow serves nothing
        logged = await records(aredis, redis_keys, 3)
        assert {(r.node_id, r.shadow_id, r.shadow_node_id, r.shadow_node_region) for r in logged} == {
            (1, 7, 2, "eu-central")
        }
        shadow_cost, live_cost = logged[0].shadow_cost, logged[0].cost
        assert (shadow_cost.node_id, shadow_cost.rtt_ms, live_cost.node_id, live_cost.rtt_ms) == (
            2,
            150.0,
            1,
            1.0,
        )
        assert shadow_cost.prefill_ms < live_cost.prefill_ms  # why the shadow wanted gpu-b

    async def test_it_prices_both_sides_when_the_algorithms_price_nothing(
        self, aredis, redis_keys, redis_url, stubs
    ):
        snapshot = make_snapshot(two_regions(stubs), shadow=trial("shadow", RoundRobinParams()))
        await publish(aredis, redis_keys, snapshot)
        async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
            await wait_for(lambda: gateway.app.runtime.store.table is not None)
            assert (await gateway.http.post("/v1/chat/completions", json=BODY)).status_code == 200
        (logged,) = await records(aredis, redis_keys, 1)
        assert (
            logged.cost is not None and logged.cost.node_id == logged.node_id and logged.cost.prefill_ms > 0
        )
        assert logged.shadow_cost is not None and logged.shadow_cost.node_id == logged.shadow_node_id

    async def test_a_gateway_that_cannot_load_the_shadow_serves_the_live_policy(
        self, aredis, redis_keys, redis_url, stubs
    ):
        unknown = msgspec.Raw(
            b'{"id":9,"kind":"shadow","policy":{"id":2,"name":"x","algorithm":"future","params":{"type":"future"}}}'
        )
        snapshot = msgspec.structs.replace(make_snapshot(two_regions(stubs)), shadow=unknown)
        await publish(aredis, redis_keys, snapshot)
        async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
            await wait_for(lambda: gateway.app.runtime.store.table is not None)
            assert gateway.app.runtime.store.table.shadow is None
            assert (await gateway.http.post("/v1/chat/completions", json=BODY)).status_code == 200
        (logged,) = await records(aredis, redis_keys, 1)
        assert logged.shadow_id is None and logged.node_id in (1, 2)


class TestCanary:
    async def test_it_serves_its_share_of_sessions_and_keeps_each_on_one_side(
        self, aredis, redis_keys, redis_url, stubs
    ):
        # The live policy keeps us-east clients at home (gpu-a); the canary sends them to gpu-b.
        home = (ResidencyRule("us-east", ("us-east",)),)
        canary = trial(
            "canary", RoundRobinParams(), share=0.3, residency=(ResidencyRule("us-east", ("eu-central",)),)
        )
        snapshot = make_snapshot(two_regions(stubs), residency=home, canary=canary)
        await publish(aredis, redis_keys, snapshot)
        sessions = [f"conversation-{index}" for index in range(60)]
        async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
            await wait_for(lambda: gateway.app.runtime.store.table is not None)
            served: dict[str, set[str]] = {}
            for _turn in range(2):
                for session in sessions:
                    answer = await gateway.http.post(
                        "/v1/chat/completions", json=BODY, headers={"x-session-id": session}
                    )
                    served.setdefault(session, set()).add(answer.headers["x-gorgo-node"])
        assert all(len(nodes) == 1 for nodes in served.values())  # a conversation stays on one side
        on_canary = {session for session, nodes in served.items() if nodes == {"gpu-b"}}
        route = TrialRoute(canary, None, canary.policy.params, {}, int(0.3 * 2**64), b"s4lt", False)  # type: ignore[arg-type]
        assert on_canary == {session for session in sessions if in_canary(route, session)}
        assert 0.1 < len(on_canary) / len(sessions) < 0.5
        logged = await records(aredis, redis_keys, 120)
        assert {(r.arm, r.node_id) for r in logged} == {("canary", 2), ("live", 1)}
        assert {r.canary_id for r in logged} == {7}


def test_the_canary_hash_picks_its_share_of_keys() -> None:
    route = canary_route(
        make_snapshot((make_node(1),), canary=trial("canary", RoundRobinParams(), share=0.1))
    )
    share = sum(in_canary(route, f"key-{index}") for index in range(20_000)) / 20_000
    assert 0.09 < share < 0.11


def test_two_canaries_pick_their_sessions_independently() -> None:
    """crc32 continued from the salt is linear: for keys of one length (UUID sessions) two canaries'
    hashes differed by a constant, so a session in one was in the other with probability ~0 or
    ~0.75 instead of the other's share."""
    import uuid

    keys = [str(uuid.UUID(int=index * 7_919 + 12_345, version=4)) for index in range(20_000)]
    for pair in range(6):
        first = canary_route(
            make_snapshot(
                (make_node(1),), canary=trial("canary", RoundRobinParams(), share=0.1, salt=f"{pair:016x}")
            )
        )
        second = canary_route(
            make_snapshot(
                (make_node(1),),
                canary=trial("canary", RoundRobinParams(), share=0.1, salt=f"{pair + 1000:016x}"),
            )
        )
        in_first = [key for key in keys if in_canary(first, key)]
        both = sum(in_canary(second, key) for key in in_first) / len(in_first)
        assert 0.07 < both < 0.13, (pair, both)  # independent: about the second's share


def test_a_shadow_keeps_its_own_guards_on_a_canary_request() -> None:
    """The live policy and its shadow may use us-east only, the canary eu-central only. On a request
    in the canary the view is the canary's: the shadow took its candidates and "chose" a node its
    own residency forbids, so the experiment logged a comparison with a policy that cannot exist."""
    from routing.algorithms.base import RoutingRequest, RoutingView
    from routing.contract import LeastLoadParams
    from routing.proxy.shadow import decide_with_shadow

    home = (ResidencyRule("us-east", ("us-east",)),)
    abroad = (ResidencyRule("us-east", ("eu-central",)),)
    nodes = (make_node(1, region="us-east"), make_node(2, region="eu-central"))
    snapshot = make_snapshot(
        nodes,
        residency=home,
        shadow=trial("shadow", LeastLoadParams(), trial_id=8, residency=home),
        canary=trial("canary", RoundRobinParams(), share=0.5, residency=abroad),
    )
    shadow = load_trial(snapshot.shadow, snapshot, "us-east", REGISTRY, {}, {})
    canary = canary_route(snapshot)
    assert shadow is not None and shadow.same_guards and not canary.same_guards
    view = RoutingView("us-east", canary.candidates[MODEL], canary.params)  # a canary request's view
    decision, outcome = decide_with_shadow(
        canary.algorithm, shadow, view, RoutingRequest(MODEL, 400, 100), live_view=False
    )
    assert decision.node.id == 2  # the canary's own choice, abroad
    assert outcome.node is not None and outcome.node.id == 1  # the shadow's, within its residency


async def test_a_shadow_with_candidates_of_its_own_sees_their_cached_prefixes(
    aredis, redis_keys, redis_url, stubs
) -> None:
    """The live policy may use us-east only; the shadow (gorgo, blind to RTT) may use both nodes.
    The index was matched over the live candidates only, so the shadow priced its other node as a
    full miss however much of the prompt it held: node 2, which holds it and prefills 5x faster,
    lost to node 1."""
    import time as clock

    nodes = (
        make_node(1, stubs[0].url, name="gpu-a", region="us-east"),
        make_node(2, stubs[1].url, name="gpu-b", region="eu-central", prefill_tokens_per_s=50_000.0),
    )
    shadow = trial("shadow", GorgoParams(w_rtt=0.0))  # no residency: nodes 1 and 2
    snapshot = make_snapshot(
        nodes, params=GorgoParams(), residency=(ResidencyRule("us-east", ("us-east",)),), shadow=shadow
    )
    await publish(aredis, redis_keys, snapshot)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "route me " * 450}]}
    async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
        await wait_for(lambda: gateway.app.runtime.store.table is not None)
        assert (await gateway.http.post("/v1/chat/completions", json=body)).status_code == 200
        (first,) = await records(aredis, redis_keys, 1)
        assert first.node_id == 1 and first.prefix_hashes
        index = gateway.app.prefix_index
        index.insert_hashes(2, first.prefix_hashes, clock.time())  # node 2 holds the prompt too
        assert index.match_hashes(first.prefix_hashes, (2,), clock.time()).get(2, 0) > 0
        assert (await gateway.http.post("/v1/chat/completions", json=body)).status_code == 200
        second = (await records(aredis, redis_keys, 2))[1]
    # both hold it: 5x the prefill speed on node 2 wins for a shadow that ignores the round trip
    assert second.node_id == 1 and second.shadow_node_id == 2, (second.node_id, second.shadow_cost)
