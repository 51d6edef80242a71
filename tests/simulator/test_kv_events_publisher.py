"""The emulated nodes publish vLLM's KV events over real ZMQ sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio

from simulator.fleet import Fleet
from simulator.kv_events import KVEventsConfig, Publisher, parse_kv_events_config
from simulator.text import text_of_tokens
from simulator.topology import DEFAULT_TOPOLOGY_PATH, TopologyError, load_topology, parse_topology

NODE = "us-east-1"
SMALL_ENGINE = {"kv_capacity_blocks": 300, "max_model_len": 2048}


def events_config(encoding: str = "map", replay: bool = True, **extra: str) -> str:
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:0",
        "encoding": encoding,
        **extra,
    }
    if replay:
        config["replay_endpoint"] = "tcp://*:0"
    return json.dumps(config)


class Listener:
    """A plain ZMQ SUB socket, as any consumer of vLLM's events would open."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)

    async def messages(self, quiet_s: float = 0.3) -> list[list[bytes]]:
        frames = []
        while await self.sub.poll(quiet_s * 1000):
            frames.append(await self.sub.recv_multipart())
        return frames

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()


async def chat(session: aiohttp.ClientSession, url: str, seed: int, tokens: int = 400) -> dict:
    body = {
        "messages": [{"role": "user", "content": text_of_tokens(random.Random(seed), tokens)}],
        "max_tokens": 2,
    }
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        assert response.status == 200
        return await response.json()


async def settle(listener: Listener) -> None:
    await asyncio.sleep(0.3)  # the SUB socket's subscription reaches the publisher


def event_tag(event) -> str:
    return event[0] if isinstance(event, list) else event["type"]


@pytest.mark.parametrize("encoding", ["legacy", "map"])
async def test_it_publishes_stored_blocks_in_three_frames_in_either_encoding(encoding: str) -> None:
    topology = load_topology(DEFAULT_TOPOLOGY_PATH)
    async with Fleet.start(
        topology, auto_ports=True, only=[NODE], kv_events={NODE: events_config(encoding)}, time_scale=0.05
    ) as fleet:
        node = fleet.node(NODE)
        assert node.kv_events_endpoint.startswith("tcp://127.0.0.1:")
        listener = Listener(node.kv_events_endpoint)
        await settle(listener)
        async with aiohttp.ClientSession() as session:
            await chat(session, node.url, 1)
        messages = await listener.messages()
        listener.close()
        pool = node.engine.pool
    assert messages
    stored: list = []
    for number, (topic, seq, payload) in enumerate(messages):
        assert topic == b"" and len(seq) == 8 and int.from_bytes(seq, "big") == number
        batch = msgspec.msgpack.decode(payload)
        if encoding == "legacy":
            assert isinstance(batch, list) and batch[2] == 0  # [ts, events, data_parallel_rank]
            events = batch[1]
            assert all(isinstance(event, list) for event in events)  # tag first
        else:  # vLLM 0.32: the batch is still an array, each event a map tagged "type"
            assert isinstance(batch, list) and batch[2] == 0
            events = batch[1]
            assert all(isinstance(event, dict) for event in events)
        stored += [event for event in events if event_tag(event) == "BlockStored"]
    first = stored[0]
    if encoding == "legacy":
        hashes, parent, token_ids, block_size = first[1], first[2], first[3], first[4]
        assert all(isinstance(h, int) for h in hashes)
    else:
        hashes, parent, token_ids, block_size = (
            first["block_hashes"],
            first["parent_block_hash"],
            first["token_ids"],
            first["block_size"],
        )
        assert all(isinstance(h, int) and 0 <= h < 1 << 64 for h in hashes)  # 0.32's default
        assert first["medium"] == "GPU" and first["lora_name"] is None
        assert first["extra_keys"] == [None] * len(hashes)  # one per block; no salt, no LoRA
    assert parent is None and block_size == 16 and len(token_ids) == 16 * len(hashes)
    published = sum(len(e[1] if encoding == "legacy" else e["block_hashes"]) for e in stored)
    assert published == pool.num_cached_blocks


async def test_it_publishes_evictions_and_a_reset() -> None:
    topology = load_topology(DEFAULT_TOPOLOGY_PATH)
    async with Fleet.start(
        topology,
        auto_ports=True,
        only=[NODE],
        kv_events={NODE: events_config("legacy")},
        engine_overrides=SMALL_ENGINE,
        time_scale=0.05,
    ) as fleet:
        node = fleet.node(NODE)
        listener = Listener(node.kv_events_endpoint)
        await settle(listener)
        async with aiohttp.ClientSession() as session:
            for seed in range(20):  # 20 x ~400 tokens through a 4,800-token cache
                await chat(session, node.url, seed)
            async with session.post(node.url + "/reset_prefix_cache") as response:
                assert response.status == 200
        messages = await listener.messages()
        listener.close()
        assert node.engine.pool.num_cached_blocks == 0
    tags = [event[0] for _, _, payload in messages for event in msgspec.msgpack.decode(payload)[1]]
    assert "BlockRemoved" in tags
    assert tags[-1] == "AllBlocksCleared"


async def test_it_replays_from_a_sequence_number_and_ends_with_minus_one_in_the_pre_032_format() -> None:
    """Older vLLM's reply, (seq, payload) after the delimiter: the gateway must keep reading it.
    vLLM 0.32's reply (with the topic) is pinned by tests/conformance on both targets."""
    topology = load_topology(DEFAULT_TOPOLOGY_PATH)
    config = events_config(replay_format="pre-0.32")
    async with Fleet.start(
        topology, auto_ports=True, only=[NODE], kv_events={NODE: config}, time_scale=0.05
    ) as fleet:
        node = fleet.node(NODE)
        async with aiohttp.ClientSession() as session:
            for seed in range(3):
                await chat(session, node.url, seed)
        sent = node.publisher.batches_sent
        assert sent >= 3
        ctx = zmq.asyncio.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(node.kv_events_replay_endpoint)
        await dealer.send_multipart((b"", (1).to_bytes(8, "big")))
        replies = []
        while True:
            assert await dealer.poll(5000)
            _, seq, payload = await dealer.recv_multipart()
            number = int.from_bytes(seq, "big", signed=True)
            replies.append(number)
            if number == -1:
                assert payload == b""
                break
            assert msgspec.msgpack.decode(payload)[1]
        dealer.close(linger=0)
        ctx.term()
    assert replies == [*range(1, sent), -1]


async def test_a_restart_draws_new_hashes_and_starts_from_sequence_zero() -> None:
    topology = load_topology(DEFAULT_TOPOLOGY_PATH)
    async with Fleet.start(
        topology, auto_ports=True, only=[NODE], kv_events={NODE: events_config()}, time_scale=0.05
    ) as fleet:
        node = fleet.node(NODE)
        endpoint = node.kv_events_endpoint
        first_seen: list[tuple[int, bytes]] = []
        for _ in range(2):
            listener = Listener(node.kv_events_endpoint)
            await settle(listener)
            async with aiohttp.ClientSession() as session:
                await chat(session, node.url, 7)
            (_, seq, payload), *_ = await listener.messages()
            listener.close()
            event = msgspec.msgpack.decode(payload)[1][0]
            first_seen.append((int.from_bytes(seq, "big"), event["block_hashes"][0]))
            await fleet.stop_node(NODE)
            await fleet.start_node(NODE)
        assert node.kv_events_endpoint == endpoint  # a restart keeps its ports
    (seq_a, hash_a), (seq_b, hash_b) = first_seen
    assert seq_a == seq_b == 0
    assert hash_a != hash_b  # the same prompt, a different random root


async def test_data_parallel_ranks_publish_on_the_base_port_plus_their_rank() -> None:
    base = Publisher(parse_kv_events_config(events_config()), "127.0.0.1")
    base.start()
    port = int(base.endpoint.rpartition(":")[2])
    await base.stop()
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}")
    rank = Publisher(config, "127.0.0.1", data_parallel_rank=2)
    rank.start()
    try:
        assert rank.endpoint == f"tcp://127.0.0.1:{port + 2}"
        listener = Listener(rank.endpoint)
        await settle(listener)
        from simulator.kv_events import AllBlocksCleared

        rank.publish([AllBlocksCleared()])
        (_, _, payload), *_ = await listener.messages()
        listener.close()
        assert msgspec.msgpack.decode(payload)[2] == 2  # [ts, events, data_parallel_rank]
    finally:
        await rank.stop()


def test_the_topology_and_the_flag_take_vllms_json_and_reject_bad_keys() -> None:
    raw = {
        "regions": [{"slug": "r", "latitude": 0, "longitude": 0}],
        "nodes": [
            {
                "name": "n",
                "region": "r",
                "kv_events_config": '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}',
            }
        ],
    }
    node = parse_topology(raw).nodes[0]
    assert node.kv_events is not None and node.kv_events.enabled and node.kv_events.encoding == "map"
    raw["nodes"][0]["kv_events_config"] = {"enable_kv_cache_events": True, "encoding": "xml"}
    with pytest.raises(TopologyError, match=r"nodes\[0\]\.kv_events_config\.encoding"):
        parse_topology(raw)
    raw["nodes"][0]["kv_events_config"] = {"enable_kv_cache_events": True, "endpoints": "x"}
    with pytest.raises(TopologyError, match="unknown key"):
        parse_topology(raw)


def test_the_demo_fleet_publishes_events_on_loopback() -> None:
    topology = load_topology(DEFAULT_TOPOLOGY_PATH)
    configs = [node.kv_events for node in topology.nodes]
    assert all(config is not None and config.enabled for config in configs)
    assert {config.encoding for config in configs} == {"legacy", "map"}  # a mixed fleet
