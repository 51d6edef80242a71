"""The dashboard socket while Redis is down: closed cleanly with 1013, and it resumes by itself.

A private redis-server (a real process on a free port) carries the channel layer, so the test can
stop it under an open socket and start it again, as an outage would.
"""

from __future__ import annotations

import asyncio
import shutil

import pytest
import redis.asyncio
from channels.layers import get_channel_layer
from django.test import Client

from controlplane.dashboard.consumers import CLOSE_TRY_AGAIN_LATER, DashboardConsumer
from telemetry.groups import DASHBOARD_GROUP
from tests.conftest import ProcessGroup, free_port
from tests.dashboard.test_consumer import communicator

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs a redis-server binary"),
]


@pytest.fixture
def session_key(operator) -> str:
    client = Client()
    client.force_login(operator.user)
    return client.cookies["sessionid"].value


@pytest.fixture
def private_redis(processes: ProcessGroup, settings):
    """A redis-server of this test's own, carrying the channel layer; ``start()``/``stop()`` it."""
    port = free_port()

    def start() -> None:
        processes.start(
            "redis",
            ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
            ready_text="Ready to accept connections",
        )

    def stop() -> None:
        processes.stop("redis")

    layers = {**settings.CHANNEL_LAYERS["default"]}
    layers["CONFIG"] = {**layers["CONFIG"], "hosts": [f"redis://127.0.0.1:{port}/0"]}
    settings.CHANNEL_LAYERS = {"default": layers}  # resets the layer (channels listens to settings)
    start()
    return start, stop


async def expect_close(socket, code: int) -> None:
    message = await socket.receive_output(timeout_s=5)
    assert message == {"type": "websocket.close", "code": code}
    await socket.wait()  # re-raises whatever the application raised: there must be nothing


async def test_it_refuses_cleanly_while_redis_is_down_and_resumes(session_key, private_redis) -> None:
    start, stop = private_redis
    await asyncio.to_thread(stop)
    socket = communicator(session_key)
    connected, _ = await socket.connect()
    assert connected  # accepted only to say why it closes: not a handshake 500
    await expect_close(socket, CLOSE_TRY_AGAIN_LATER)

    await asyncio.to_thread(start)  # Redis is back: the browser's next attempt works
    socket = communicator(session_key)
    connected, _ = await socket.connect()
    assert connected
    await get_channel_layer().group_send(DASHBOARD_GROUP, {"type": "telemetry.health", "node_id": 1})
    assert (await socket.receive_json_from(timeout_s=5))["type"] == "telemetry.health"
    await socket.disconnect()


async def test_an_open_socket_closes_cleanly_when_redis_goes_away(session_key, private_redis) -> None:
    _start, stop = private_redis
    socket = communicator(session_key)
    connected, _ = await socket.connect()
    assert connected
    await asyncio.to_thread(stop)
    await expect_close(socket, CLOSE_TRY_AGAIN_LATER)


async def test_an_open_socket_gets_updates_again_after_redis_lost_its_membership(
    session_key, private_redis, monkeypatch
) -> None:
    """A FLUSHALL (or a failover to an empty replica that keeps the connection, or channels_redis's
    group_expiry) drops the group's membership under an open socket, which stays open: it must
    join again by itself, or the page gets no update until it is reloaded."""
    monkeypatch.setattr(DashboardConsumer, "rejoin_s", 0.2, raising=False)
    socket = communicator(session_key)
    connected, _ = await socket.connect()
    assert connected
    layer = get_channel_layer()
    server = redis.asyncio.Redis.from_url(layer.hosts[0]["address"])
    await server.flushall()
    # Bounded wait for a membership to be written again (never, before: the socket stayed a member
    # of nothing); receive_output cancels the application on a timeout, so it is not polled.
    for _ in range(100):
        if await server.keys("*group*"):
            break
        await asyncio.sleep(0.1)
    await server.aclose()

    await layer.group_send(DASHBOARD_GROUP, {"type": "telemetry.health", "node_id": 1})
    assert (await socket.receive_json_from(timeout_s=5))["type"] == "telemetry.health"
    await socket.disconnect()
