"""Issue 26, item 1: the gateway does the opposite of the node. A vLLM that binds (``tcp://*:P``) is
connected to at the node's host; a vLLM that connects out sends to gorgo's relay, which binds that
address and re-publishes for every gateway; a node that serves requests and sends no event is
flagged (mode, metric, Nodes page, log line naming the endpoint-shape rule)."""

from __future__ import annotations

import logging
import socket

import pytest

from routing.cache.kv_events.collector import KVEventsCollector
from routing.cache.kv_events.manager import KVEvents
from routing.cache.kv_events.subscriber import (
    SILENT_AFTER_S,
    SILENT_MIN_REQUESTS,
    EventSource,
    connectable,
)
from routing.cache.kv_relay import KVRelay
from routing.contract import KVEventsSpec
from simulator.kv_events import KVEventsConfig, Publisher
from simulator.tcp_delay import TcpDelayProxy
from tests.routing.kv_support import LossyPublisher, stored
from tests.routing.support import wait_for

NODE_ID = 1


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("tcp://*:5557", "tcp://10.0.0.5:5557"),
        ("tcp://0.0.0.0:5557", "tcp://10.0.0.5:5557"),
        ("tcp://[::]:5557", "tcp://10.0.0.5:5557"),
        ("tcp://10.0.0.9:5567", "tcp://10.0.0.9:5567"),  # a relay's publish endpoint: as given
        ("ipc:///tmp/kv", "ipc:///tmp/kv"),
    ],
)
def test_it_connects_to_a_bound_node_endpoint_at_the_nodes_host(endpoint: str, expected: str) -> None:
    assert connectable(endpoint, "10.0.0.5") == expected


def test_the_node_spec_gives_both_endpoints_at_the_nodes_host() -> None:
    spec = KVEventsSpec("tcp://*:5557", "tcp://*:5558", "kv")
    assert EventSource.of_node(spec, "http://gpu-7.internal:8000") == EventSource(
        "tcp://gpu-7.internal:5557", "tcp://gpu-7.internal:5558", "kv"
    )
    assert EventSource.of_node(KVEventsSpec("tcp://*:5557"), "http://[fd00::7]:8000").endpoint == (
        "tcp://[fd00::7]:5557"
    )


async def test_two_gateways_get_every_event_of_a_connect_out_node_through_the_relay() -> None:
    # vLLM with endpoint tcp://127.0.0.1:P connects out: gorgo's relay binds P and re-publishes.
    port = free_port()
    relay = KVRelay(f"tcp://127.0.0.1:{port}", "tcp://127.0.0.1:0")
    relay.start()
    publisher = Publisher(
        KVEventsConfig(
            enable_kv_cache_events=True,
            endpoint=f"tcp://127.0.0.1:{port}",
            replay_endpoint="tcp://*:0",
        ),
        "127.0.0.1",
    )
    publisher.start()
    gateways = [KVEvents(), KVEvents()]
    try:
        for events in gateways:
            await events.sync({NODE_ID: EventSource(relay.publish_endpoint, publisher.replay_endpoint)})
        await wait_for(lambda: all(events.mode(NODE_ID) == "precise" for events in gateways))
        await wait_for(lambda: relay.stats.publishers_connected == 1)
        # A PUB drops what it sends before the subscriptions reached it (ZMQ's slow joiner): the
        # first block is sent again until both gateways hold it (a second copy of a held block counts once in `blocks`).
        for _attempt in range(50):
            publisher.publish([stored(1)])
            try:
                await wait_for(lambda: all(events.index.blocks(NODE_ID) == 1 for events in gateways), 0.2)
                break
            except AssertionError:
                continue
        for number in range(2, 6):
            publisher.publish([stored(number, parent=number - 1)])
        await wait_for(lambda: all(events.index.blocks(NODE_ID) == 5 for events in gateways))
        for events in gateways:
            stats = events.subscribers[NODE_ID].stats
            assert stats.gaps == 0 and stats.applied == stats.received >= 5
    finally:
        for events in gateways:
            await events.close()
        await publisher.stop()
        await relay.close()


async def test_a_node_that_serves_and_sends_no_event_is_flagged(caplog: pytest.LogCaptureFixture) -> None:
    # The publisher binds and stays quiet, as a vLLM whose events go elsewhere would look.
    publisher = Publisher(KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0"), "127.0.0.1")
    publisher.start()
    now = [1_000_000.0]
    events = KVEvents(clock=lambda: now[0])
    collector = KVEventsCollector(events, lambda: {NODE_ID: "us-east-1"})
    try:
        await events.sync({NODE_ID: EventSource(publisher.endpoint)})
        await wait_for(lambda: events.mode(NODE_ID) == "precise")
        for _ in range(SILENT_MIN_REQUESTS):
            events.note_served(NODE_ID)
        now[0] += SILENT_AFTER_S - 1
        assert events.mode(NODE_ID) == "precise"  # not for long enough yet
        now[0] += 1
        with caplog.at_level(logging.WARNING, logger="routing.kv_events"):
            assert events.mode(NODE_ID) == "approximate"
            assert events.state("gw", "us-east").nodes[NODE_ID].silent
        assert "binds its KV-events endpoint only when it contains '*'" in caplog.text
        assert "python -m routing.cache.kv_relay" in caplog.text
        samples = {sample.name: sample.value for family in collector.collect() for sample in family.samples}
        assert samples["gorgo_kv_events_silent"] == 1

        publisher.publish([stored(1)])  # events come: no longer silent
        await wait_for(lambda: events.index.blocks(NODE_ID) == 1)
        assert events.mode(NODE_ID) == "precise" and not events.state("gw", "us-east").nodes[NODE_ID].silent
    finally:
        await events.close()
        await publisher.stop()


async def test_a_connect_out_node_that_stops_is_forgotten_at_once_through_the_relay() -> None:
    # Behind the relay the gateway's connection never drops: the relay says the vLLM went away,
    # so a restarting node is neither predicted from its old blocks nor routed precisely.
    port = free_port()
    relay = KVRelay(f"tcp://127.0.0.1:{port}", "tcp://127.0.0.1:0")
    relay.start()
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{port}")
    publisher = Publisher(config, "127.0.0.1")
    publisher.start()
    events = KVEvents()
    try:
        await events.sync({NODE_ID: EventSource(relay.publish_endpoint)})
        await wait_for(lambda: relay.stats.publishers_connected == 1 and events.mode(NODE_ID) == "precise")
        for _attempt in range(50):  # the slow joiner, as above
            publisher.publish([stored(1)])
            try:
                await wait_for(lambda: events.index.blocks(NODE_ID) == 1, 0.2)
                break
            except AssertionError:
                continue
        await publisher.stop()  # the vLLM process ends
        await wait_for(lambda: events.index.blocks(NODE_ID) == 0)
        assert events.mode(NODE_ID) == "approximate"

        publisher = Publisher(config, "127.0.0.1")  # the new process: sequence from 0
        publisher.start()
        for _attempt in range(50):
            publisher.publish([stored(7)])
            try:
                await wait_for(lambda: events.index.blocks(NODE_ID) == 1, 0.2)
                break
            except AssertionError:
                continue
        assert events.mode(NODE_ID) == "precise"
    finally:
        await events.close()
        await publisher.stop()
        await relay.close()


def test_only_requests_that_must_store_a_block_count_toward_silence() -> None:
    # A prompt shorter than a block, or one the index showed wholly held, stores nothing: its
    # missing event is no sign of a wrong endpoint.
    from routing.cache.approx_index import ApproxPrefixIndex
    from routing.cache.kv_aware_index import KVAwareIndex

    noted: list[int] = []

    class Events:
        index = KVEvents().index
        subscribers = {NODE_ID: object()}  # the node publishes events (a node without them: below)

        def note_served(self, node_id: int) -> None:
            noted.append(node_id)

    index = KVAwareIndex(ApproxPrefixIndex(), Events())  # type: ignore[arg-type]
    index.set_block_sizes({NODE_ID: 32})
    index.note_served(NODE_ID, 20)  # under one block
    index.note_served(NODE_ID, 100, predicted_cached_tokens=96)  # every full block held
    index.note_served(NODE_ID, None)  # no usage
    assert noted == []
    index.note_served(NODE_ID, 100, predicted_cached_tokens=64)  # block 3 is new
    index.note_served(NODE_ID, 40)
    assert noted == [NODE_ID, NODE_ID]
    index.set_block_sizes({NODE_ID + 1: 32})
    index.note_served(NODE_ID + 1, 100)  # a node with no subscriber has no events to wait for
    assert noted == [NODE_ID, NODE_ID]


async def test_a_connect_out_node_that_reconnects_to_the_relay_is_replayed_whole() -> None:
    # The same vLLM process loses its connection to the relay for a moment (a network blip; ZMQ
    # reconnects on its own): the relay says it went away, so the gateway forgets its blocks, but
    # the process and its cache live on, its sequence continuing. What it held before is in its
    # replay buffer (vLLM keeps the last buffer_steps batches, whatever the connection did).
    port = free_port()
    relay = KVRelay(f"tcp://127.0.0.1:{port}", "tcp://127.0.0.1:0")
    relay.start()
    link = TcpDelayProxy("127.0.0.1", port, rtt_ms=0)  # the network between vLLM and the relay
    link_port = await link.start()
    config = KVEventsConfig(
        enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{link_port}", replay_endpoint="tcp://*:0"
    )
    publisher = Publisher(config, "127.0.0.1")
    publisher.start()
    events = KVEvents()
    try:
        await events.sync({NODE_ID: EventSource(relay.publish_endpoint, publisher.replay_endpoint)})
        await wait_for(lambda: relay.stats.publishers_connected == 1 and events.mode(NODE_ID) == "precise")
        # The slow joiner here too: the relay counts the connection before the PUB has the relay's
        # subscription, and what it sends meanwhile is dropped (seen on a busy machine: both of two
        # batches, so no gap either). Sent until one arrives; a gap brings the rest from the replay.
        for first in range(1, 51):
            publisher.publish([stored(first, parent=first - 1 if first > 1 else None)])
            try:
                await wait_for(lambda: events.index.blocks(NODE_ID) > 0, 0.2)
                break
            except AssertionError:
                continue
        publisher.publish([stored(first + 1, parent=first)])
        await wait_for(lambda: events.index.blocks(NODE_ID) == first + 1)  # live, or replayed on a gap
        subscriber = events.subscribers[NODE_ID]

        for task in list(link._tasks):  # the connection drops; vLLM's PUB connects again
            task.cancel()
        await wait_for(lambda: subscriber.stats.publisher_gone_at is not None)
        assert events.index.blocks(NODE_ID) == 0 and events.mode(NODE_ID) == "approximate"
        await wait_for(lambda: relay.stats.publishers_connected == 2)
        # The relay says it joined: replayed at once, no batch needed.
        await wait_for(lambda: not subscriber._replaying and events.mode(NODE_ID) == "precise")
        assert events.index.blocks(NODE_ID) == first + 1  # none forgotten
        # Its next batch arrives live, or (the slow joiner again) through the replay after joining.
        publisher.publish([stored(first + 2, parent=first + 1)])
        await wait_for(lambda: events.index.blocks(NODE_ID) == first + 2)
    finally:
        await events.close()
        await publisher.stop()
        await link.close()
        await relay.close()


async def test_a_connect_out_node_that_restarts_is_replayed_when_it_joins_without_waiting_for_a_batch() -> (
    None
):
    # The relay says when a vLLM connects. Before it did, a restarted connect-out node stayed
    # approximate until its next batch reached the gateway, and its first batch can be dropped by
    # its own PUB (sent before the relay's subscription reached it): a node that then idles was
    # never precise again and its first blocks were missing.
    port, replay_port = free_port(), free_port()
    relay = KVRelay(f"tcp://127.0.0.1:{port}", "tcp://127.0.0.1:0")
    relay.start()
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"tcp://127.0.0.1:{port}",
        replay_endpoint=f"tcp://*:{replay_port}",
    )
    publisher = LossyPublisher(config, "127.0.0.1")
    publisher.start()
    events = KVEvents()
    try:
        await events.sync({NODE_ID: EventSource(relay.publish_endpoint, f"tcp://127.0.0.1:{replay_port}")})
        await wait_for(lambda: relay.stats.publishers_connected == 1 and events.mode(NODE_ID) == "precise")
        await publisher.stop()  # the vLLM process ends
        await wait_for(lambda: events.mode(NODE_ID) == "approximate")

        publisher = LossyPublisher(config, "127.0.0.1")  # the new process: sequence from 0
        publisher.start()
        publisher.lose([stored(7, count=3)])  # its only batch, sent before the subscription took
        await wait_for(lambda: relay.stats.publishers_connected == 2)
        await wait_for(lambda: events.mode(NODE_ID) == "precise" and events.index.blocks(NODE_ID) == 3)
        assert events.subscribers[NODE_ID].stats.resets == 0
    finally:
        await events.close()
        await publisher.stop()
        await relay.close()
