"""Region ports: a node reached on region R's port pays R's round trip without the region header."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

from simulator.fleet import Fleet
from tests.conftest import ROOT
from tests.simulator.conftest import FAR_RTT_MS, chat_body, small_topology


class RegionsAsked:
    """Wraps a node's WAN emulator to record which client region each request was delayed for."""

    def __init__(self, fleet: Fleet, name: str) -> None:
        self.regions: list[str | None] = []
        wan = fleet.node(name).wan
        real = wan.one_way_delays_s

        def recording(region: str | None) -> tuple[float, float]:
            self.regions.append(region)
            return real(region)

        wan.one_way_delays_s = recording  # type: ignore[method-assign]


@pytest.fixture
async def fleet():
    async with Fleet.start(small_topology(), auto_ports=True, region_ports=True) as started:
        yield started


async def test_it_serves_every_node_on_one_port_per_region(fleet: Fleet) -> None:
    node = fleet.node("node-a")
    assert set(node.region_urls) == {"near", "far"}
    other = fleet.node("node-b")
    ports = {node.url, other.url, *node.region_urls.values(), *other.region_urls.values()}
    assert len(ports) == 6
    assert fleet.urls_for("far") == {
        "node-a": node.url_for("far"),
        "node-b": fleet.node("node-b").url_for("far"),
    }
    async with httpx.AsyncClient(timeout=10) as http:
        for url in node.region_urls.values():
            assert (await http.get(f"{url}/v1/models")).status_code == 200


async def test_it_applies_the_ports_region_whatever_the_header_says(fleet: Fleet) -> None:
    asked = RegionsAsked(fleet, "node-a")
    node = fleet.node("node-a")
    async with httpx.AsyncClient(timeout=10) as http:
        await http.get(f"{node.url_for('far')}/health")
        await http.get(f"{node.url_for('far')}/health", headers={"X-Gorgo-Region": "near"})
        await http.get(f"{node.url_for('near')}/health", headers={"X-Gorgo-Region": "far"})
        await http.get(f"{node.url}/health", headers={"X-Gorgo-Region": "far"})  # main port: the header
        await http.get(f"{node.url}/health")
    assert asked.regions == ["far", "far", "near", "far", None]


async def test_it_costs_the_round_trip_on_a_far_regions_port(fleet: Fleet) -> None:
    url = fleet.node("node-a").url_for("far")
    body = chat_body("Hello?", max_tokens=3, stream=True)
    async with httpx.AsyncClient(timeout=10) as http:
        started = time.perf_counter()
        first_token_ms = None
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if first_token_ms is None and '"content":"' in line and '"content":""' not in line:
                    first_token_ms = (time.perf_counter() - started) * 1000.0
    assert first_token_ms is not None and first_token_ms >= FAR_RTT_MS


async def test_it_keeps_the_region_ports_across_a_restart(fleet: Fleet) -> None:
    before = dict(fleet.node("node-a").region_urls)
    await fleet.stop_node("node-a")
    await fleet.start_node("node-a")
    assert fleet.node("node-a").region_urls == before


async def test_it_says_how_to_get_region_ports_when_they_are_off() -> None:
    async with Fleet.start(small_topology(), auto_ports=True, only=["node-a"]) as plain:
        with pytest.raises(KeyError, match="region_ports=True"):
            plain.node("node-a").url_for("far")


def test_it_prints_region_urls_as_json_from_the_command_line(tmp_path) -> None:
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "simulator", "--auto-ports", "--region-ports", "--json"),
            *(
                "--only",
                "us-east-1",
                "--engine",
                "kv_capacity_blocks=2048",
                "--engine",
                "max_model_len=16384",
            ),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert process.stdout is not None
        described = json.loads(process.stdout.readline())
        assert "simulator ready" in process.stdout.readline()
        (node,) = described["nodes"]
        assert node["name"] == "us-east-1" and set(node["region_urls"]) == {
            "us-east",
            "eu-central",
            "ap-south",
        }
        health = httpx.get(f"{node['region_urls']['ap-south']}/health", timeout=10)
        assert health.status_code == 200
    finally:
        process.terminate()
        process.wait(10)


def test_it_refuses_a_bad_engine_override_on_the_command_line() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "simulator", "--auto-ports", "--engine", "kv_capacity_blocks=lots"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2 and "kv_capacity_blocks" in result.stderr
