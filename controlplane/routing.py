"""WebSocket URL routes of every app (Channels)."""

from __future__ import annotations

websocket_urlpatterns: list = []
