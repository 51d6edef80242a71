"""WebSocket URL routes of every app (Channels)."""

from __future__ import annotations

from controlplane.dashboard.routing import websocket_urlpatterns as dashboard_websockets

websocket_urlpatterns: list = [*dashboard_websockets]
