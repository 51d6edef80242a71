"""Policy and live-state updates reach a running gateway without a restart."""

from __future__ import annotations

import asyncio
import re

import httpx

from routing.algorithms import REGISTRY
from routing.contract import LeastLoadParams, ResidencyRule
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

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def two_nodes(stubs, **first):
    return (make_node(1, stubs[0].url, name="gpu-a", **first), make_node(2, stubs[1].url, name="gpu-b"))


async def nodes_used(client: httpx.AsyncClient, url: str, count: int = 6) -> set[str]:
    answers = [await client.post(f"{url}/v1/chat/completions", json=BODY) for _ in range(count)]
    assert all(answer.status_code == 200 for answer in answers), [a.text for a in answers]
    return {answer.headers["x-gorgo-node"] for answer in answers}


def version_is(gateway, version: int):
    return lambda: (
        gateway.app.runtime.store.table is not None and gateway.app.runtime.store.table.version == version
    )


class TestPolicyUpdates:
    async def test_it_stops_using_a_node_drained_in_a_new_snapshot(
        self, aredis, redis_keys, redis_url, stubs
    ):
        await publish(aredis, redis_keys, make_snapshot(two_nodes(stubs), version=1))
        async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
            client = gateway.http
            assert await nodes_used(client, gateway.url) == {"gpu-a", "gpu-b"}
            await publish(aredis, redis_keys, make_snapshot(two_nodes(stubs, state="draining"), version=2))
            await wait_for(version_is(gateway, 2))
            assert await nodes_used(client, gateway.url) == {"gpu-b"}
            response = await client.post(f"{gateway.url}/v1/chat/completions", json=BODY)
            assert response.headers["x-gorgo-policy-version"] == "2"

    async def test_it_finishes_in_flight_requests_on_the_old_snapshot(
        self, aredis, redis_keys, redis_url, stubs
    ):
        await publish(
            aredis, redis_keys, make_snapshot((make_node(1, stubs[0].url, name="gpu-a"),), version=1)
        )
        async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
            client = gateway.http
            slow = asyncio.create_task(
                client.post(f"{gateway.url}/v1/chat/completions", json={**BODY, "stub": {"delay_s": 0.5}})
            )
            await wait_for(lambda: stubs[0].seen)
            replacement = (make_node(2, stubs[1].url, name="gpu-b"),)
            await publish(aredis, redis_keys, make_snapshot(replacement, version=2))
            await wait_for(version_is(gateway, 2))
            after = await client.post(f"{gateway.url}/v1/chat/completions", json=BODY)
            finished = await slow
        assert finished.status_code == 200
        assert (finished.headers["x-gorgo-node"], finished.headers["x-gorgo-policy-version"]) == (
            "gpu-a",
            "1",
        )
        assert (after.headers["x-gorgo-node"], after.headers["x-gorgo-policy-version"]) == ("gpu-b", "2")

    async def test_it_refuses_an_unknown_schema_version_and_keeps_the_old_policy(
        self, aredis, redis_keys, redis_url, stubs
    ):
        await publish(aredis, redis_keys, make_snapshot(two_nodes(stubs), version=1))
        async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
            store = gateway.app.runtime.store
            await publish(aredis, redis_keys, make_snapshot(two_nodes(stubs), version=2, schema_version=99))
            await wait_for(lambda: store.events.get("refused_schema_version"))
            await aredis.set(redis_keys.policy_current, b'{"schema_version": 1, "version": "x"}')
            await aredis.publish(redis_keys.policy_channel, b"not even json")
            await wait_for(lambda: store.events.get("refused_invalid"))
            async with httpx.AsyncClient() as client:
                response = await client.post(f"{gateway.url}/v1/chat/completions", json=BODY)
                metrics = (await client.get(f"{gateway.url}/metrics")).text
        assert response.status_code == 200 and response.headers["x-gorgo-policy-version"] == "1"
        # At least once: a publish racing the listener's subscribe is refused by its re-read and again
        # by the announcement; either way it is refused and counted.
        refused = re.search(
            r'gorgo_gateway_policy_events_total\{event="refused_schema_version"\} (\d+)\.0', metrics
        )
        assert refused and int(refused.group(1)) >= 1
        assert "gorgo_gateway_policy_version 1.0" in metrics

    async def test_it_refuses_a_policy_whose_algorithm_it_lacks(self, aredis, redis_keys, redis_url, stubs):
        registry = {"round_robin": REGISTRY["round_robin"]}
        await publish(aredis, redis_keys, make_snapshot(two_nodes(stubs), version=1))
        async with running_gateway(gateway_config(redis_keys, redis_url), registry=registry) as gateway:
            store = gateway.app.runtime.store
            await publish(
                aredis, redis_keys, make_snapshot(two_nodes(stubs), version=2, params=LeastLoadParams())
            )
            await wait_for(lambda: store.events.get("refused_algorithm"))
            assert store.table is not None and store.table.version == 1

    async def test_it_drops_nodes_marked_unhealthy_in_live_state(self, aredis, redis_keys, redis_url, stubs):
        await publish(aredis, redis_keys, make_snapshot(two_nodes(stubs)))
        async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
            client = gateway.http
            await publish_live(aredis, redis_keys, healthy={1: False, 2: True})
            await wait_for(lambda: [n.id for n in gateway.app.runtime.store.table.candidates[MODEL]] == [2])
            assert await nodes_used(client, gateway.url) == {"gpu-b"}
            await publish_live(aredis, redis_keys, healthy={1: True})
            await wait_for(lambda: len(gateway.app.runtime.store.table.candidates[MODEL]) == 2)
            assert await nodes_used(client, gateway.url) == {"gpu-a", "gpu-b"}

    async def test_it_drops_nodes_beyond_max_rtt_from_its_region(self, aredis, redis_keys, redis_url, stubs):
        await publish(aredis, redis_keys, make_snapshot(two_nodes(stubs), max_rtt_ms=100.0))
        async with running_gateway(gateway_config(redis_keys, redis_url, region="ap-south")) as gateway:
            await publish_live(aredis, redis_keys, rtt_ms={("ap-south", 1): 235.0, ("us-east", 2): 235.0})
            await wait_for(lambda: [n.id for n in gateway.app.runtime.store.table.candidates[MODEL]] == [2])
            async with httpx.AsyncClient() as client:
                assert await nodes_used(client, gateway.url) == {"gpu-b"}

    async def test_it_applies_the_residency_rule_of_its_region(self, aredis, redis_keys, redis_url, stubs):
        nodes = (
            make_node(1, stubs[0].url, name="us-node", region="us-east"),
            make_node(2, stubs[1].url, name="eu-node", region="eu-central"),
        )
        rules = (ResidencyRule("eu-central", ("eu-central",)),)
        await publish(aredis, redis_keys, make_snapshot(nodes, residency=rules))
        async with (
            running_gateway(gateway_config(redis_keys, redis_url, region="eu-central")) as eu,
            running_gateway(gateway_config(redis_keys, redis_url, region="us-east")) as us,
            httpx.AsyncClient() as client,
        ):
            assert await nodes_used(client, eu.url) == {"eu-node"}
            assert await nodes_used(client, us.url) == {"us-node", "eu-node"}
