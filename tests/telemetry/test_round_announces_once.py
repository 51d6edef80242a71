"""A round decides health first, then writes and announces live state once.

Counted on the real channels: the test publishes a sentinel after the round on the same channel
(Redis delivers a channel's messages in the order it executed the PUBLISHes), so everything the
round announced arrives before it and nothing has to be waited out.
"""

from __future__ import annotations

import asyncio

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

from telemetry import rounds
from telemetry.groups import DASHBOARD_GROUP
from tests.telemetry.conftest import make_node, make_regions

pytestmark = pytest.mark.django_db

SENTINEL = "sentinel"


@pytest.fixture
def announcements(tel):
    """Returns how many live-state announcements the gateways saw since the last call."""
    pubsub = tel.client.pubsub()
    pubsub.subscribe(tel.keys.live_channel)
    assert pubsub.get_message(timeout=5.0)["type"] == "subscribe"

    def count() -> int:
        tel.client.publish(tel.keys.live_channel, SENTINEL)
        seen = 0
        while True:
            message = pubsub.get_message(timeout=5.0)
            assert message is not None, "the sentinel never arrived"
            if message["data"] == SENTINEL.encode():
                return seen
            seen += 1

    yield count
    pubsub.close()


@pytest.fixture
def pushes(tel):
    """Returns the types of the dashboard pushes since the last call, in order."""
    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(DASHBOARD_GROUP, channel)

    async def _receive() -> dict:
        return await asyncio.wait_for(layer.receive(channel), 5.0)

    def types() -> list[str]:
        async_to_sync(layer.group_send)(DASHBOARD_GROUP, {"type": SENTINEL})
        seen = []
        while (message := async_to_sync(_receive)())["type"] != SENTINEL:
            seen.append(message["type"])
        return seen

    yield types
    async_to_sync(layer.group_discard)(DASHBOARD_GROUP, channel)


def test_it_announces_a_scrape_round_once_even_when_health_changes(tel, http, stubs, announcements, pushes):
    make_node("use-1", make_regions("us-east")["us-east"], stubs().url)

    first = rounds.scrape_round(tel.client, tel.keys, http)
    assert (first.transitions, announcements(), pushes()) == (0, 1, ["telemetry.nodes"])

    second = rounds.scrape_round(tel.client, tel.keys, http)  # the second success: unknown -> healthy
    assert (second.transitions, announcements(), pushes()) == (1, 1, ["telemetry.health", "telemetry.nodes"])


def test_a_probe_round_announces_live_state_only_when_health_changes(tel, http, announcements):
    make_node("use-1", make_regions("us-east")["us-east"], "http://127.0.0.1:9")

    for _ in range(2):
        assert rounds.probe_round(tel.client, tel.keys, http, "us-east").transitions == 0
        assert announcements() == 0  # no RTT sample and no health change: nothing a gateway routes on

    assert rounds.probe_round(tel.client, tel.keys, http, "us-east").transitions == 1  # third failure
    assert announcements() == 1
