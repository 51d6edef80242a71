"""A WebSocket test client for ASGI apps: the part of ``channels.testing.WebsocketCommunicator`` we use.

``channels.testing`` imports daphne (for its live-server test case) as soon as it is imported;
gorgo serves with uvicorn and does not install daphne, so the few methods the consumer tests need
are here, on asgiref's ``ApplicationCommunicator``, with the same names and behaviour.
"""

from __future__ import annotations

import json
from typing import Any
from unittest import mock

from asgiref.testing import ApplicationCommunicator


def _no_op() -> None:
    pass


class WebsocketCommunicator(ApplicationCommunicator):
    """Drives one WebSocket connection through an ASGI application."""

    def __init__(self, application: Any, path: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        scope = {
            "type": "websocket",
            "path": path,
            "query_string": b"",
            "headers": headers or [],
            "subprotocols": [],
        }
        super().__init__(application, scope)

    # As channels' communicator does: the test owns the database connections, the app must not close them.
    async def send_input(self, message: dict) -> None:
        with mock.patch("channels.db.close_old_connections", _no_op):
            return await super().send_input(message)

    async def receive_output(self, timeout_s: float = 1) -> dict:
        with mock.patch("channels.db.close_old_connections", _no_op):
            return await super().receive_output(timeout_s)

    async def connect(self, timeout_s: float = 2) -> tuple[bool, Any]:
        """(True, subprotocol) when accepted, (False, close code) when refused."""
        await self.send_input({"type": "websocket.connect"})
        response = await self.receive_output(timeout_s)
        if response["type"] == "websocket.close":
            return False, response.get("code", 1000)
        assert response["type"] == "websocket.accept"
        return True, response.get("subprotocol")

    async def receive_json_from(self, timeout_s: float = 2) -> Any:
        response = await self.receive_output(timeout_s)
        assert response["type"] == "websocket.send", response
        return json.loads(response["text"])

    async def disconnect(self, code: int = 1000, timeout_s: float = 2) -> None:
        await self.send_input({"type": "websocket.disconnect", "code": code})
        await self.wait(timeout_s)
