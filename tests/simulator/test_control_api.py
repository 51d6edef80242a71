"""The control API crashes and restarts nodes of a running fleet, for demos and fault drills."""

from __future__ import annotations

import httpx
import pytest

from simulator.control import serve_control
from simulator.harness import free_port
from tests.simulator.conftest import FleetFactory


async def test_it_stops_and_starts_a_node_by_name(make_fleet: FleetFactory, http: httpx.AsyncClient) -> None:
    fleet = await make_fleet()
    port = free_port()
    runner = await serve_control(fleet, "127.0.0.1", port)
    control = f"http://127.0.0.1:{port}"
    node_url = fleet.url("node-a")
    try:
        listed = (await http.get(f"{control}/nodes")).json()["nodes"]
        assert {n["name"]: n["up"] for n in listed}["node-a"] is True

        stopped = await http.post(f"{control}/nodes/node-a/stop")
        assert stopped.json() == {"name": "node-a", "up": False}
        with pytest.raises(httpx.ConnectError):
            await http.get(f"{node_url}/health")

        started = await http.post(f"{control}/nodes/node-a/start")
        assert started.json() == {"name": "node-a", "up": True}
        assert (await http.get(f"{node_url}/health")).status_code == 200

        unknown = await http.post(f"{control}/nodes/nope/stop")
        assert unknown.status_code == 404 and "nope" in unknown.json()["error"]
    finally:
        await runner.cleanup()
