"""The gateway's KV-event subscriber against real ZMQ publishers on 127.0.0.1 (the simulator's)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest

from routing.cache.kv_events import subscriber as subscriber_module
from routing.cache.kv_events.decoder import decode_batch
from routing.cache.kv_events.manager import KVEvents
from routing.cache.kv_events.subscriber import EventSource
from routing.cache.precise_index import block_keys
from routing.cache.tokenization import ModelTokenizer
from simulator.fleet import Fleet
from simulator.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventsConfig,
    Publisher,
    encode_batch,
)
from simulator.model_folder import CHAT_TEMPLATE_PATH, TOKENIZER_PATH
from simulator.text import text_of_tokens
from simulator.topology import DEFAULT_TOPOLOGY_PATH, load_topology
from tests.routing.kv_support import LossyPublisher, stored
from tests.routing.support import wait_for

NODE = "us-east-1"
NODE_ID = 1


# The emulator answers replay as vLLM 0.32 does by default (with the topic frame); the gateway still
# reads the older reply, which one test keeps speaking.
PRE_032_REPLAY = "pre-0.32"


def events_config(encoding: str, replay: bool = True) -> str:
    config = {
        "enable_kv_cache_events": True,
        "endpoint": "tcp://*:0",
        "encoding": encoding,
    }
    if replay:
        config["replay_endpoint"] = "tcp://*:0"
    return json.dumps(config)


def chat_body(seed: int, tokens: int = 600) -> dict:
    content = text_of_tokens(random.Random(seed), tokens)
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 2}


@contextlib.asynccontextmanager
async def subscribed_node(
    encoding: str = "map", **fleet_options: Any
) -> AsyncIterator[tuple[Fleet, Any, KVEvents]]:
    """One emulated node publishing KV events and a subscriber to it, precise before it yields."""
    async with Fleet.start(
        load_topology(DEFAULT_TOPOLOGY_PATH),
        auto_ports=True,
        only=[NODE],
        kv_events={NODE: events_config(encoding)},
        time_scale=0.05,
        **fleet_options,
    ) as fleet:
        node = fleet.node(NODE)
        events = KVEvents()
        await events.sync({NODE_ID: EventSource(node.kv_events_endpoint, node.kv_events_replay_endpoint)})
        try:
            await wait_for(lambda: events.mode(NODE_ID) == "precise")
            yield fleet, node, events
        finally:
            await events.close()


@contextlib.asynccontextmanager
async def subscribed(publisher: Publisher) -> AsyncIterator[KVEvents]:
    """A subscriber to ``publisher`` (started by the caller; stopped here, after)."""
    events = KVEvents()
    try:
        await events.sync({NODE_ID: EventSource(publisher.endpoint, publisher.replay_endpoint)})
        yield events
    finally:
        await events.close()
        await publisher.stop()


# ---- decoding ----------------------------------------------------------------------------------


class TestDecoding:
    def test_it_decodes_the_legacy_positional_encoding(self):
        payload = encode_batch(
            [BlockStored((11, 12), None, tuple(range(32)), 16), BlockRemoved((11,)), AllBlocksCleared()],
            1.5,
            0,
            "legacy",
        )
        batch = decode_batch(payload)
        stored, removed, cleared = batch.events
        assert (batch.ts, batch.data_parallel_rank) == (1.5, 0)
        assert stored.block_hashes == [11, 12] and stored.parent_block_hash is None
        assert stored.token_ids == list(range(32)) and stored.block_size == 16
        assert removed.block_hashes == [11]
        assert type(cleared).__name__ == "Cleared"

    def test_it_decodes_the_map_encoding_with_byte_hashes(self):
        # vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 sends byte hashes (the emulator sends ints)
        event = {
            "type": "BlockStored",
            "block_hashes": [(11).to_bytes(8, "big")],
            "parent_block_hash": (10).to_bytes(8, "big"),
            "token_ids": list(range(16)),
            "block_size": 16,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        }
        payload = msgspec.msgpack.encode({"ts": 2.0, "events": [event], "data_parallel_rank": 3})
        batch = decode_batch(payload)
        assert batch.data_parallel_rank == 3
        assert batch.events[0].block_hashes == [(11).to_bytes(8, "big")]
        assert batch.events[0].parent_block_hash == (10).to_bytes(8, "big")

    def test_it_ignores_fields_it_does_not_know_in_both_encodings(self):
        legacy = [
            9.0,
            [
                ["BlockStored", [1], None, list(range(16)), 16, None, "GPU", None, [["x"]], 0, "full", None],
                ["BlockRemoved", [1], "GPU", 0, "future"],
                ["KVCompacted", 1, 2],  # a future event type
            ],
            0,
            "extra batch field",
        ]
        batch = decode_batch(msgspec.msgpack.encode(legacy))
        assert [type(e).__name__ for e in batch.events] == ["Stored", "Removed"]
        assert batch.unknown == 1
        new = {
            "ts": 9.0,
            "events": [
                {
                    "type": "BlockStored",
                    "block_hashes": [b"\x01"],
                    "parent_block_hash": None,
                    "token_ids": list(range(16)),
                    "block_size": 16,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "kv_cache_spec_kind": "full",
                    "something_new": {"nested": True},
                },
                {"type": "Unheard"},
            ],
            "data_parallel_rank": 0,
            "added_later": 1,
        }
        batch = decode_batch(msgspec.msgpack.encode(new))
        assert batch.events[0].block_hashes == [b"\x01"] and batch.unknown == 1

    def test_offloaded_blocks_are_kept_apart_from_the_gpu_copy(self):
        payload = msgspec.msgpack.encode(
            [0.0, [["BlockStored", [1], None, list(range(16)), 16, None, "CPU"]], 0]
        )
        assert decode_batch(payload).events[0].block_hashes == [("CPU", 1)]


# ---- against the simulator ---------------------------------------------------------------------


@pytest.mark.parametrize("encoding", ["legacy", "map"])
async def test_the_index_predicts_exactly_what_the_node_then_reports_cached(encoding: str) -> None:
    tokenizer = ModelTokenizer(str(TOKENIZER_PATH), str(CHAT_TEMPLATE_PATH))
    evicting = {"kv_capacity_blocks": 400, "max_model_len": 2048}
    async with subscribed_node(encoding, engine_overrides=evicting) as (_fleet, node, events):
        checked = 0
        async with aiohttp.ClientSession() as session:
            for number in range(24):
                body = chat_body(number % 8)
                ids = tokenizer.prompt_ids("chat", json.dumps(body).encode())
                assert ids is not None and ids.complete
                keys = block_keys(ids.ids, 16, (len(ids.ids) - 1) // 16)
                predicted = events.index.match_keys(keys, [NODE_ID], 16).get(NODE_ID, 0)
                async with session.post(node.url + "/v1/chat/completions", json=body) as response:
                    usage = (await response.json())["usage"]
                assert usage["prompt_tokens"] == len(ids.ids)
                assert predicted == usage["prompt_tokens_details"]["cached_tokens"]
                checked += predicted > 0
                # The events of this request arrive before the next is sent.
                await wait_for(lambda: events.index.blocks(NODE_ID) == node.engine.pool.num_cached_blocks)
        assert checked >= 5
        stats = events.subscribers[NODE_ID].stats
        assert stats.applied == stats.received and stats.gaps == 0


async def test_a_restart_or_a_reset_empties_the_nodes_blocks() -> None:
    async with subscribed_node() as (fleet, node, events), aiohttp.ClientSession() as session:
        await session.post(node.url + "/v1/chat/completions", json=chat_body(1))
        await wait_for(lambda: events.index.blocks(NODE_ID) > 0)

        await fleet.stop_node(NODE)
        await wait_for(lambda: events.mode(NODE_ID) == "approximate")  # disconnected
        await fleet.start_node(NODE)
        await wait_for(lambda: events.mode(NODE_ID) == "precise")
        assert events.index.blocks(NODE_ID) == 0  # a new process: nothing cached

        async with session.post(node.url + "/v1/chat/completions", json=chat_body(2)) as response:
            assert response.status == 200, await response.text()
        try:
            await wait_for(lambda: events.index.blocks(NODE_ID) == node.engine.pool.num_cached_blocks > 0)
        except AssertionError as error:
            stats = events.subscribers[NODE_ID].stats
            raise AssertionError(
                f"index {events.index.blocks(NODE_ID)} blocks, node {node.engine.pool.num_cached_blocks}; {stats}"
            ) from error
        async with session.post(node.url + "/reset_prefix_cache") as response:
            assert response.status == 200
        await wait_for(lambda: events.index.blocks(NODE_ID) == 0)


def publisher_config(buffer_steps: int = 100, replay_format: str = "v0.32") -> KVEventsConfig:
    return KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint="tcp://*:0",
        replay_endpoint="tcp://*:0",
        buffer_steps=buffer_steps,
        replay_format=replay_format,
    )


@pytest.mark.parametrize(
    ("buffer_steps", "replay_format"), [(100, "v0.32"), (100, PRE_032_REPLAY), (1, "v0.32")]
)
async def test_a_sequence_gap_is_replayed_or_resets_the_node(buffer_steps: int, replay_format: str) -> None:
    publisher = LossyPublisher(publisher_config(buffer_steps, replay_format), "127.0.0.1")
    publisher.start()
    async with subscribed(publisher) as events:
        await wait_for(lambda: events.mode(NODE_ID) == "precise")
        publisher.publish([stored(1)])
        await wait_for(lambda: events.index.blocks(NODE_ID) == 1)
        publisher.lose([stored(2, parent=1)])  # seq 1 never arrives live
        publisher.publish([stored(3, parent=2)])  # seq 2 reveals the gap
        subscriber = events.subscribers[NODE_ID]
        await wait_for(lambda: subscriber.stats.gaps == 1)
        if buffer_steps > 1:
            # Replayed: nothing lost, still precise.
            await wait_for(lambda: events.index.blocks(NODE_ID) == 3)
            assert events.mode(NODE_ID) == "precise"
            assert subscriber.stats.resets == 0
        else:
            # The buffer no longer has seq 1: the node starts over and is approximate a while
            # (the gap is counted before the replay that fails, so wait for its end).
            await wait_for(lambda: subscriber.stats.resets == 1)
            assert events.index.blocks(NODE_ID) == 0  # block 3's parent is unknown: not keyed
            assert subscriber.stats.dropped["unknown_parent"] == 1
            assert events.mode(NODE_ID) == "approximate"
            assert events.mode(NODE_ID, time.time() + 60) == "precise"


async def test_a_batch_sent_before_the_subscription_took_effect_is_replayed() -> None:
    # ZMQ's PUB drops what it sends before a new SUB's subscription reaches it. The subscriber is
    # connected and its replay done (precise), so a batch lost that way shows no gap until the node
    # next changes its cache, which may be never: the precise index would miss the node's first
    # blocks after every restart. A replay shortly after the connection's catches it.
    publisher = LossyPublisher(publisher_config(), "127.0.0.1")
    publisher.start()
    async with subscribed(publisher) as events:
        await wait_for(lambda: events.mode(NODE_ID) == "precise")
        publisher.lose([stored(1, count=2)])  # the node's only change: no later batch follows
        subscriber = events.subscribers[NODE_ID]
        await wait_for(lambda: events.index.blocks(NODE_ID) == 2)
        assert subscriber.stats.gaps == 1 and subscriber.stats.resets == 0
        assert events.mode(NODE_ID) == "precise"


class HeldCatchUpPublisher(Publisher):
    """The simulator's publisher that answers the first replay (the connection's) at once and holds
    every later one (the catch-ups) until ``release`` is set."""

    def __init__(self, config: KVEventsConfig, host: str) -> None:
        super().__init__(config, host)
        self.catch_up_asked = asyncio.Event()
        self.release = asyncio.Event()

    async def _serve_replay(self, socket) -> None:
        answered = 0
        while True:
            client, delimiter, _start = await socket.recv_multipart()
            if answered:
                self.catch_up_asked.set()
                await self.release.wait()
            answered += 1
            await socket.send_multipart((client, delimiter, b"", END_SEQ, b""))


async def test_a_catch_up_replay_leaves_the_node_precise(monkeypatch: pytest.MonkeyPatch) -> None:
    # The catch-up only looks for what the live stream might have missed: the index is whole while
    # it runs. Marked as a replay under way, it turned the node approximate for its round trip, and
    # a real vLLM test saw a request decided in that window routed approximately.
    monkeypatch.setattr(subscriber_module, "CATCH_UP_AFTER_S", (0.1,))
    publisher = HeldCatchUpPublisher(publisher_config(), "127.0.0.1")
    publisher.start()
    async with subscribed(publisher) as events:
        await wait_for(lambda: events.mode(NODE_ID) == "precise")
        await wait_for(publisher.catch_up_asked.is_set)
        assert events.mode(NODE_ID) == "precise"
        publisher.release.set()


class PausingReplayPublisher(Publisher):
    """The simulator's publisher whose replay stops after its first batch until ``resume`` is set."""

    def __init__(self, config: KVEventsConfig, host: str) -> None:
        super().__init__(config, host)
        self.resume = asyncio.Event()

    async def _serve_replay(self, socket) -> None:
        client, delimiter, _start = await socket.recv_multipart()
        for number, (seq, payload) in enumerate(list(self._buffer)):
            if number == 1:
                await self.resume.wait()
            await socket.send_multipart((client, delimiter, self._topic, seq.to_bytes(8, "big"), payload))
        await socket.send_multipart((client, delimiter, b"", END_SEQ, b""))
        await asyncio.Event().wait()  # one replay is all this test asks for


async def test_a_node_is_approximate_until_its_replay_is_whole() -> None:
    # A late subscriber (a second gateway, a reconnection) replays what the node holds batch by
    # batch; predictions from the first batch alone under-count every later block, so the node
    # stays approximate until the replay's end (a real vLLM's 51-block replay was read at 31).
    publisher = PausingReplayPublisher(publisher_config(), "127.0.0.1")
    publisher.start()
    publisher.publish([stored(1)])
    publisher.publish([stored(2, parent=1)])
    publisher.publish([stored(3, parent=2)])
    async with subscribed(publisher) as events:
        await wait_for(lambda: events.index.blocks(NODE_ID) == 1)  # the first batch is applied
        assert events.mode(NODE_ID) == "approximate"
        publisher.resume.set()
        await wait_for(lambda: events.mode(NODE_ID) == "precise")
        assert events.index.blocks(NODE_ID) == 3


async def test_a_replay_of_old_batches_is_not_lag() -> None:
    # A gateway subscribing to a node that has been idle for a minute replays batches a minute
    # old (vLLM's replay buffer keeps the last buffer_steps, whatever their age): the index is
    # whole and current, so the node is precise. Lag is the age of what arrives live.
    publisher = Publisher(publisher_config(), "127.0.0.1")
    publisher.start()
    publisher.publish([stored(1)])
    publisher.publish([stored(2, parent=1)])
    events = KVEvents(clock=lambda: time.time() + 60)  # the gateway subscribes a minute later
    try:
        await events.sync({NODE_ID: EventSource(publisher.endpoint, publisher.replay_endpoint)})
        subscriber = events.subscribers[NODE_ID]
        await wait_for(lambda: subscriber._expected == 2 and not subscriber._replaying)
        assert events.mode(NODE_ID) == "precise"
        publisher.publish([stored(3, parent=2)])  # a batch a minute old on arrival: lagging
        await wait_for(lambda: events.index.blocks(NODE_ID) == 3)
        assert events.mode(NODE_ID) == "approximate"
    finally:
        await events.close()
        await publisher.stop()


async def test_a_sequence_back_to_zero_empties_the_node_at_once() -> None:
    # vLLM 0.32 restarted behind a relay (the gateway's connection never drops): the only sign is
    # the sequence starting again at 0, and no AllBlocksCleared comes. The new process holds
    # nothing it has not announced: the old blocks must go with the first new batch.
    publisher = LossyPublisher(publisher_config(), "127.0.0.1")
    publisher.start()
    async with subscribed(publisher) as events:
        await wait_for(lambda: events.mode(NODE_ID) == "precise")
        publisher.publish([stored(1)])
        publisher.publish([stored(2, parent=1)])
        publisher.publish([stored(3, parent=2)])
        await wait_for(lambda: events.index.blocks(NODE_ID) == 3)

        publisher._seq = 0  # the new process
        publisher._buffer.clear()
        publisher.publish([stored(50)])
        subscriber = events.subscribers[NODE_ID]
        await wait_for(lambda: subscriber.stats.restarts == 1)
        assert events.index.blocks(NODE_ID) == 1  # block 50 only
        assert events.mode(NODE_ID) == "precise"
        publisher.publish([stored(51, parent=50)])
        await wait_for(lambda: events.index.blocks(NODE_ID) == 2)
        assert subscriber.stats.gaps == 0 and subscriber.stats.restarts == 1


async def test_two_cache_salts_are_predicted_apart() -> None:
    # Same prompt, another salt: the emulated vLLM (as the real one) reuses nothing, and the index
    # must predict nothing; the same salt again is a full hit.
    tokenizer = ModelTokenizer(str(TOKENIZER_PATH), str(CHAT_TEMPLATE_PATH))
    async with subscribed_node() as (_fleet, node, events), aiohttp.ClientSession() as session:
        seen = []
        for salt in ("tenant-a", "tenant-b", "tenant-a", None):
            body = chat_body(77) | ({"cache_salt": salt} if salt else {})
            ids = tokenizer.prompt_ids("chat", json.dumps(body).encode())
            assert ids is not None and ids.complete
            keys = block_keys(ids.ids, 16, (len(ids.ids) - 1) // 16, ids.tenant)
            predicted = events.index.match_keys(keys, [NODE_ID], 16).get(NODE_ID, 0)
            async with session.post(node.url + "/v1/chat/completions", json=body) as response:
                usage = (await response.json())["usage"]
            seen.append((predicted, usage["prompt_tokens_details"]["cached_tokens"]))
            await wait_for(lambda: events.index.blocks(NODE_ID) == node.engine.pool.num_cached_blocks)
    assert [actual for _, actual in seen][:2] == [0, 0] and seen[2][1] > 0
    assert [predicted for predicted, _ in seen] == [actual for _, actual in seen]
