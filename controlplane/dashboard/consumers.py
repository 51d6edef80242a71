"""The dashboard's live-update socket (``/ws/dashboard/``)."""

from __future__ import annotations

from typing import Any

from channels.generic.websocket import AsyncJsonWebsocketConsumer

from telemetry.groups import DASHBOARD_GROUP

# Close code for "sign in first" (4000-4999 are the application's). The socket is accepted and
# then closed so the browser sees the code and stops retrying instead of looping on a 403.
CLOSE_UNAUTHENTICATED = 4401


class DashboardConsumer(AsyncJsonWebsocketConsumer):
    """Forwards telemetry's dashboard updates (and new policy versions) to one signed-in browser.

    Anonymous sockets are closed with ``CLOSE_UNAUTHENTICATED``. Messages reach the browser as
    JSON with the same ``type`` and fields the group message had (docs/telemetry.md,
    docs/dashboard.md); the browser only listens, anything it sends is ignored.
    """

    groups_joined: tuple[str, ...] = ()

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.accept()
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return
        await self.channel_layer.group_add(DASHBOARD_GROUP, self.channel_name)
        self.groups_joined = (DASHBOARD_GROUP,)
        await self.accept()

    async def disconnect(self, code: int) -> None:
        for group in self.groups_joined:
            await self.channel_layer.group_discard(group, self.channel_name)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        return None  # the page only listens

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

    async def policy_published(self, event: dict[str, Any]) -> None:
        """A new policy version went live (sent by ``controlplane.dashboard.signals``)."""
        await self.send_json(event)
