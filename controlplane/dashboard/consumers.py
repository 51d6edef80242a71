"""The dashboard's live-update socket (``/ws/dashboard/``)."""

from __future__ import annotations

import asyncio
import logging
from importlib import import_module
from types import SimpleNamespace
from typing import Any

import redis
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings
from django.contrib.auth import get_user

from telemetry.groups import DASHBOARD_GROUP

# Close code for "sign in first" (4000-4999 are the application's). The socket is accepted and
# then closed so the browser sees the code and stops retrying instead of looping on a 403.
CLOSE_UNAUTHENTICATED = 4401
# "Try again later" (RFC 6455): the channel layer (Redis) is unreachable. The browser shows that
# it is reconnecting and retries with backoff until Redis is back.
CLOSE_TRY_AGAIN_LATER = 1013
# What an unreachable channel layer raises (redis-py's errors, or the socket's own).
LAYER_ERRORS = (redis.RedisError, OSError)

log = logging.getLogger(__name__)


def _signed_in_user_id(session_key: str | None) -> int | None:
    """Who the session ``session_key`` signs in now, read afresh from the session store: ``None``
    once it was logged out (flushed), expired, its user's password changed (the session's auth
    hash) or the account was deactivated; Django's own check, as for a page request."""
    if not session_key:
        return None
    store = import_module(settings.SESSION_ENGINE).SessionStore(session_key)
    user = get_user(SimpleNamespace(session=store))  # type: ignore[arg-type]
    return user.pk if user.is_authenticated else None


class DashboardConsumer(AsyncJsonWebsocketConsumer):
    """Forwards telemetry's dashboard updates (and new policy versions) to one signed-in browser.

    Anonymous sockets are closed with ``CLOSE_UNAUTHENTICATED``; while Redis (the channel layer)
    is unreachable, sockets are closed cleanly with ``CLOSE_TRY_AGAIN_LATER``, never with a
    traceback and an HTTP 500, and the browser reconnects by itself. Messages reach the browser as
    JSON with the same ``type`` and fields the group message had (docs/telemetry.md,
    docs/dashboard.md); the browser only listens, anything it sends is ignored.
    """

    groups_joined: tuple[str, ...] = ()
    # How often an open socket joins its groups again. Redis can lose the membership while the
    # socket stays open (a FLUSHALL, a failover to an empty replica that kept the connection;
    # channels_redis also drops it after its ``group_expiry``, a day): the page then got no update
    # again until it was reloaded, with nothing to say so. A join is one ZADD and one EXPIRE.
    # Before each join the socket's session is read again: a socket opened before its user logged
    # out (or the session expired, the password changed, the account was deactivated) kept
    # receiving the fleet's telemetry for as long as it stayed open; it now closes with
    # ``CLOSE_UNAUTHENTICATED`` within this period.
    rejoin_s: float = 10.0
    _rejoining: asyncio.Task[None] | None = None

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.accept()
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return
        try:
            await self.channel_layer.group_add(DASHBOARD_GROUP, self.channel_name)
        except LAYER_ERRORS as exc:
            log.warning("dashboard socket refused for now: channel layer unreachable: %s", exc)
            await self.accept()  # accepted only to be able to say why it closes
            await self.close(code=CLOSE_TRY_AGAIN_LATER)
            return
        self.groups_joined = (DASHBOARD_GROUP,)
        self._rejoining = asyncio.create_task(self._stay_joined(), name="dashboard-rejoin")
        await self.accept()

    async def _stay_joined(self) -> None:
        while True:
            await asyncio.sleep(self.rejoin_s)
            if not await self._still_signed_in():
                log.info("dashboard socket closed: its session no longer signs its user in")
                self._rejoining = None  # this task ends here; disconnect() must not cancel it
                await self.close(code=CLOSE_UNAUTHENTICATED)
                return
            for group in self.groups_joined:
                try:
                    await self.channel_layer.group_add(group, self.channel_name)
                except LAYER_ERRORS:
                    pass  # Redis away: the layer's receive loop closes the socket (1013)

    async def _still_signed_in(self) -> bool:
        session, user = self.scope.get("session"), self.scope.get("user")
        if session is None or user is None:
            return False
        try:
            user_id = await database_sync_to_async(_signed_in_user_id)(session.session_key)
        except Exception as exc:  # the database away: keep the socket, look again next period
            log.warning("dashboard socket: cannot re-read its session (%s)", exc)
            return True
        return user_id is not None and user_id == user.pk

    async def __call__(self, scope, receive, send) -> None:
        # The layer's receive loop runs beside the socket's; when Redis goes away under an open
        # socket it raises here. Close the socket cleanly instead of dying with a traceback.
        try:
            await super().__call__(scope, receive, send)
        except LAYER_ERRORS as exc:
            log.warning("dashboard socket closed: channel layer unreachable: %s", exc)
            try:
                await send({"type": "websocket.close", "code": CLOSE_TRY_AGAIN_LATER})
            except Exception:
                pass
        finally:
            self._stop_rejoining()

    def _stop_rejoining(self) -> None:
        if self._rejoining is not None:
            self._rejoining.cancel()
            self._rejoining = None

    async def disconnect(self, code: int) -> None:
        self._stop_rejoining()  # first: a join after the discard below would outlive the socket
        for group in self.groups_joined:
            try:
                await self.channel_layer.group_discard(group, self.channel_name)
            except LAYER_ERRORS:
                pass  # the membership expires in Redis by itself (channels_redis group_expiry)

    async def receive(
        self, text_data: str | None = None, bytes_data: bytes | None = None, **kwargs: Any
    ) -> None:
        # The page only listens. Not decoded: the JSON consumer's own receive raises on a frame that
        # is not JSON text, which killed the socket without leaving the group (it stayed a member
        # for channels_redis' group_expiry, a day), so anyone signed in could pile up members.
        return None

    async def telemetry_rtt(self, event: dict[str, Any]) -> None:
        """A region finished a probe round: RTT from it to every node."""
        await self.send_json(event)

    async def telemetry_nodes(self, event: dict[str, Any]) -> None:
        """A scrape round finished: load, KV usage and hit rate of every node."""
        await self.send_json(event)

    async def telemetry_health(self, event: dict[str, Any]) -> None:
        """A node turned healthy or unhealthy."""
        await self.send_json(event)

    async def telemetry_aggregates(self, event: dict[str, Any]) -> None:
        """An aggregation round updated request buckets (TTFT, breakdown, tokens)."""
        await self.send_json(event)

    async def policy_experiment(self, event: dict[str, Any]) -> None:
        """A shadow's or canary's figures changed, or it ended (issue 23)."""
        await self.send_json(event)

    async def policy_published(self, event: dict[str, Any]) -> None:
        """A new policy version went live (sent by ``controlplane.dashboard.signals``)."""
        await self.send_json(event)
