"""A gateway routes a mixed fleet: nodes with KV events precisely, the others approximately."""

from __future__ import annotations

import asyncio
import json
import random
import re

import msgspec

from routing.contract import GorgoParams, KVEventsSpec, ModelSpec
from simulator.fleet import Fleet
from simulator.model_folder import MODEL_FILES_DIR
from simulator.text import text_of_tokens
from simulator.topology import DEFAULT_TOPOLOGY_PATH, load_topology
from tests.routing.support import (
    MODEL,
    gateway_config,
    make_node,
    make_snapshot,
    publish,
    running_gateway,
    wait_for,
)

NODES = ("us-east-1", "us-east-2", "eu-central-1")
EVENTS = {
    "us-east-1": {"enable_kv_cache_events": True, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"},
    "us-east-2": {"enable_kv_cache_events": True, "endpoint": "tcp://*:0", "encoding": "legacy"},
    "eu-central-1": {"enable_kv_cache_events": False},
}


def snapshot_for(fleet: Fleet, *, tokenizer: bool):
    nodes = []
    for number, name in enumerate(NODES, start=1):
        node = make_node(number, fleet.url(name), name=name)
        sim = fleet.node(name)
        if sim.kv_events_endpoint:
            endpoint = sim.kv_events_endpoint
            if name == "us-east-1":
                # As an operator copies vLLM's --kv-events-config: the gateway reads "*" as the
                # node's host (its base_url's, 127.0.0.1 here).
                endpoint = "tcp://*:" + endpoint.rpartition(":")[2]
            node = msgspec.structs.replace(
                node, kv_events=KVEventsSpec(endpoint, sim.kv_events_replay_endpoint)
            )
        nodes.append(node)
    snapshot = make_snapshot(tuple(nodes), params=GorgoParams())
    if tokenizer:
        # Configured by its folder, as a real model is: tokenizer.json, tokenizer_config.json.
        model = ModelSpec(MODEL, 16, 8192, model_folder=str(MODEL_FILES_DIR))
        snapshot = msgspec.structs.replace(snapshot, models=(model,))
    return snapshot


def metric(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


async def send_conversations(gateway, rounds: int) -> None:
    """Three conversations at a time (so load spreads them over the nodes), a turn per round."""
    systems = [text_of_tokens(random.Random(90 + i), 800) for i in range(3)]

    async def turn(conversation: int, number: int) -> None:
        body = {
            "model": MODEL,
            "max_tokens": 2,
            "messages": [
                {"role": "system", "content": systems[conversation]},
                {"role": "user", "content": text_of_tokens(random.Random(number), 100)},
            ],
        }
        response = await gateway.http.post("/v1/chat/completions", content=json.dumps(body))
        assert response.status_code == 200

    for number in range(rounds):
        await asyncio.gather(*(turn(conversation, number) for conversation in range(3)))
        await asyncio.sleep(0.2)  # the round's events reach the gateway


async def test_a_mixed_fleet_is_routed_precisely_where_nodes_publish_events(aredis, redis_keys, redis_url):
    topology = load_topology(DEFAULT_TOPOLOGY_PATH)
    async with Fleet.start(
        topology, auto_ports=True, only=list(NODES), kv_events=EVENTS, time_scale=0.05
    ) as fleet:
        await publish(aredis, redis_keys, snapshot_for(fleet, tokenizer=True))
        async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
            app = gateway.app
            await wait_for(lambda: app.kv_events.mode(1) == "precise" and app.kv_events.mode(2) == "precise")
            assert app.kv_events.mode(3) == "approximate"  # no events configured
            await send_conversations(gateway, 5)
            text = (await gateway.http.get("/metrics")).text
    assert metric(text, "gorgo_kv_index_precise", node="us-east-1") == 1.0
    assert metric(text, "gorgo_kv_index_precise", node="us-east-2") == 1.0
    assert metric(text, "gorgo_kv_index_precise", node="eu-central-1") is None
    assert metric(text, "gorgo_kv_events_silent", node="us-east-1") == 0.0
    assert metric(text, "gorgo_kv_events_received_total", node="us-east-1") is not None
    assert metric(text, "gorgo_kv_index_blocks", node="us-east-1") is not None
    precise_predicted = sum(
        metric(text, "gorgo_prefix_predicted_cached_tokens_total", node=name, mode="precise") or 0
        for name in NODES
    )
    precise_actual = sum(
        metric(text, "gorgo_prefix_actual_cached_tokens_total", node=name, mode="precise") or 0
        for name in NODES
    )
    assert precise_actual > 0  # some conversations landed on the nodes with events
    # Each round's events arrived before the next round: the prediction is exact.
    assert abs(precise_predicted - precise_actual) <= 0.02 * precise_actual


async def test_without_a_tokenizer_the_model_falls_back_to_the_approximate_index(
    aredis, redis_keys, redis_url
):
    topology = load_topology(DEFAULT_TOPOLOGY_PATH)
    async with Fleet.start(
        topology, auto_ports=True, only=list(NODES), kv_events=EVENTS, time_scale=0.05
    ) as fleet:
        await publish(aredis, redis_keys, snapshot_for(fleet, tokenizer=False))
        async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
            app = gateway.app
            await wait_for(lambda: app.kv_events.mode(1) == "precise")
            await send_conversations(gateway, 3)
            text = (await gateway.http.get("/metrics")).text
    modes = {
        mode
        for name in NODES
        for mode in ("precise", "approximate")
        if metric(text, "gorgo_prefix_actual_cached_tokens_total", node=name, mode=mode) is not None
    }
    assert modes == {"approximate"}


def cached_token_totals(text: str) -> float:
    return sum(
        metric(text, f"gorgo_prefix_{kind}_cached_tokens_total", node=name, mode=mode) or 0
        for kind in ("predicted", "actual")
        for name in NODES
        for mode in ("precise", "approximate")
    )


async def test_a_policy_that_never_asks_the_index_records_no_prediction(aredis, redis_keys, redis_url):
    # The index's last prediction (of a gorgo decision) used to be copied onto every later request:
    # a round_robin run then logged requests as "precise" with another request's prediction.
    topology = load_topology(DEFAULT_TOPOLOGY_PATH)
    async with Fleet.start(
        topology, auto_ports=True, only=list(NODES), kv_events=EVENTS, time_scale=0.05
    ) as fleet:
        snapshot = snapshot_for(fleet, tokenizer=True)
        await publish(aredis, redis_keys, snapshot)
        async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
            app = gateway.app
            await wait_for(lambda: app.kv_events.mode(1) == "precise" and app.kv_events.mode(2) == "precise")
            await send_conversations(gateway, 2)
            before = cached_token_totals((await gateway.http.get("/metrics")).text)
            assert before > 0
            await publish(
                aredis, redis_keys, make_snapshot(snapshot.nodes, version=2, models=snapshot.models)
            )
            store = app.runtime.store
            await wait_for(lambda: store.table is not None and store.table.version == 2)
            await send_conversations(gateway, 3)
            after = cached_token_totals((await gateway.http.get("/metrics")).text)
    assert after == before
