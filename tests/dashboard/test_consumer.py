"""The /ws/dashboard/ socket through the real ASGI stack: anonymous refused, signed-in users get updates."""

from __future__ import annotations

import copy
import json
import time

import pytest
import redis.asyncio as aioredis
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.test import Client

from controlplane.asgi import application
from controlplane.dashboard.consumers import CLOSE_UNAUTHENTICATED
from controlplane.policies.models import RoutingPolicy
from controlplane.policies.publishing import publish
from telemetry.groups import DASHBOARD_GROUP, NodeCell, NodesUpdate, RTTCell, RTTUpdate
from tests.dashboard.websocket import WebsocketCommunicator

ORIGIN = (b"origin", b"http://127.0.0.1:8000")
HOST = (b"host", b"127.0.0.1:8000")  # the page's own origin, as a browser sends both


def communicator(
    session_key: str | None = None, origin: tuple[bytes, bytes] = ORIGIN, host: tuple[bytes, bytes] = HOST
) -> WebsocketCommunicator:
    headers = [origin, host]
    if session_key:
        headers.append((b"cookie", f"sessionid={session_key}".encode()))
    return WebsocketCommunicator(application, "/ws/dashboard/", headers=headers)


@pytest.fixture
def session_key(operator) -> str:
    client = Client()
    client.force_login(operator.user)
    return client.cookies["sessionid"].value


@pytest.mark.django_db(transaction=True)
async def test_it_closes_an_anonymous_socket_with_4401() -> None:
    socket = communicator()
    connected, _ = await socket.connect()
    assert connected  # accepted only to be able to say why it closes
    closing = await socket.receive_output(timeout_s=2)
    assert closing == {"type": "websocket.close", "code": CLOSE_UNAUTHENTICATED}
    await socket.wait()


@pytest.mark.django_db(transaction=True)
async def test_it_forwards_every_telemetry_update_type(session_key: str) -> None:
    socket = communicator(session_key)
    connected, _ = await socket.connect()
    assert connected
    layer = get_channel_layer()
    now = time.time()
    updates = [
        RTTUpdate(ts=now, region="us-east", cells=(RTTCell(node_id=3, ok=True, rtt_ms=88.0, jitter_ms=2.0),)),
        NodesUpdate(ts=now, nodes=(NodeCell(node_id=3, healthy=True, scrape_ok=True, num_running=4.0),)),
    ]
    for update in updates:
        await layer.group_send(DASHBOARD_GROUP, update.as_message())
        assert await socket.receive_json_from(timeout_s=3) == json.loads(json.dumps(update.as_message()))
    health = {
        "type": "telemetry.health",
        "ts": now,
        "node_id": 3,
        "node": "eu-central-1",
        "previous": "healthy",
        "current": "unhealthy",
        "check": "probe",
        "reason": "3 failed probes",
    }
    await layer.group_send(DASHBOARD_GROUP, health)
    assert await socket.receive_json_from(timeout_s=3) == health
    aggregates = {"type": "telemetry.aggregates", "ts": now, "resolution": "10s", "buckets": []}
    await layer.group_send(DASHBOARD_GROUP, aggregates)
    assert await socket.receive_json_from(timeout_s=3) == aggregates
    await socket.disconnect()


@pytest.mark.django_db(transaction=True)
async def test_it_pushes_a_new_policy_version_to_open_dashboards(session_key: str, operator, policy) -> None:
    socket = communicator(session_key)
    connected, _ = await socket.connect()
    assert connected

    @sync_to_async
    def publish_now() -> None:
        publish(RoutingPolicy.objects.get(pk=policy.pk), author=operator.user, note="from the test")

    await publish_now()
    message = await socket.receive_json_from(timeout_s=3)
    assert message["type"] == "policy.published"
    assert (message["name"], message["version"], message["author"], message["note"]) == (
        "default",
        1,
        "op",
        "from the test",
    )
    await socket.disconnect()


@pytest.mark.django_db(transaction=True)
async def test_it_leaves_the_group_on_disconnect(session_key: str, settings, redis_url: str) -> None:
    # channels_redis keeps a group's members in a sorted set under the layer's prefix.
    group_key = f"{settings.CHANNEL_LAYERS['default']['CONFIG']['prefix']}:group:{DASHBOARD_GROUP}"
    conn = aioredis.Redis.from_url(redis_url)
    try:
        before = await conn.zcard(group_key)
        socket = communicator(session_key)
        await socket.connect()
        assert await conn.zcard(group_key) == before + 1
        await socket.disconnect()
        assert await conn.zcard(group_key) == before
    finally:
        await conn.aclose()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "frame", [{"text": "not json"}, {"bytes": b"\x00\x01"}, {"text": '{"type": "telemetry.rtt"}'}]
)
async def test_it_ignores_what_the_browser_sends(
    session_key: str, settings, redis_url: str, frame: dict
) -> None:
    # The page only listens. A frame that is not JSON (or not text) made the consumer raise: the
    # socket died with a traceback and, never disconnected, stayed in the group for a day
    # (channels_redis' group_expiry), so any signed-in user could pile up members every push visits.
    group_key = f"{settings.CHANNEL_LAYERS['default']['CONFIG']['prefix']}:group:{DASHBOARD_GROUP}"
    # A layer of this test's own (channels resets it when the setting changes): one left by an
    # earlier test holds locks of that test's event loop.
    settings.CHANNEL_LAYERS = copy.deepcopy(settings.CHANNEL_LAYERS)
    conn = aioredis.Redis.from_url(redis_url)
    try:
        before = await conn.zcard(group_key)
        socket = communicator(session_key)
        assert (await socket.connect())[0]
        await socket.send_input({"type": "websocket.receive", **frame})
        health = {"type": "telemetry.health", "ts": time.time(), "node_id": 3, "current": "healthy"}
        await get_channel_layer().group_send(DASHBOARD_GROUP, health)
        assert await socket.receive_json_from(timeout_s=3) == health  # still open, still fed
        await socket.disconnect()
        assert await conn.zcard(group_key) == before
    finally:
        await conn.aclose()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("ended_by", ["logout", "deactivation"])
async def test_it_closes_a_socket_whose_user_is_no_longer_signed_in(
    operator, settings, monkeypatch, ended_by: str
) -> None:
    """A dashboard socket opened before its user logged out (or was deactivated) kept receiving
    the fleet's live telemetry for as long as it stayed open. It now reads its session again at
    each rejoin and closes with 4401."""
    import asyncio

    from controlplane.dashboard.consumers import DashboardConsumer

    monkeypatch.setattr(DashboardConsumer, "rejoin_s", 0.2)
    settings.CHANNEL_LAYERS = copy.deepcopy(settings.CHANNEL_LAYERS)  # a layer of this test's loop

    def signed_in() -> Client:
        browser = Client()
        browser.force_login(operator.user)
        return browser

    browser = await sync_to_async(signed_in)()
    socket = communicator(browser.cookies["sessionid"].value)
    assert (await socket.connect())[0]
    await asyncio.sleep(0.5)  # rejoins with the session still good: the socket stays, still fed
    health = {"type": "telemetry.health", "ts": time.time(), "node_id": 3, "current": "healthy"}
    await get_channel_layer().group_send(DASHBOARD_GROUP, health)
    assert await socket.receive_json_from(timeout_s=3) == health
    if ended_by == "logout":
        await sync_to_async(browser.logout)()
    else:
        operator.user.is_active = False
        await sync_to_async(operator.user.save)()
    closing = await socket.receive_output(timeout_s=3)
    assert closing == {"type": "websocket.close", "code": CLOSE_UNAUTHENTICATED}
    await socket.disconnect()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("origin", "host", "accepted"),
    [
        (b"http://127.0.0.1:8000", b"127.0.0.1:8000", True),  # the page's own origin
        (b"https://localhost", b"localhost", True),  # behind a TLS proxy: wss, the same host
        (b"http://localhost:8000", b"gorgo-app:8000", True),  # a proxy rewrote Host: a trusted origin
        (b"http://127.0.0.1:3000", b"127.0.0.1:8000", False),  # another port of the same host
        (b"http://localhost:5173", b"localhost:8000", False),
        (b"http://evil.example", b"127.0.0.1:8000", False),
        (b"null", b"127.0.0.1:8000", False),
    ],
)
async def test_it_accepts_sockets_from_the_dashboards_own_origin_only(
    session_key: str, origin: bytes, host: bytes, accepted: bool
) -> None:
    """The origin check compared the Origin's host with ALLOWED_HOSTS and ignored its port: a page
    on any other port of the same host (cookies are not per port) opened the socket with the
    operator's session and read the fleet's telemetry. The Origin must now be the Host the
    handshake went to, or one of CSRF_TRUSTED_ORIGINS."""
    socket = communicator(session_key, origin=(b"origin", origin), host=(b"host", host))
    connected, code = await socket.connect()
    assert connected is accepted, code  # refused: closed before it was accepted (a 403 handshake)
    if accepted:
        await socket.disconnect()
