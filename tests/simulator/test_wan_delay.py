"""WAN emulation: ``X-Gorgo-Region`` costs the configured round trip (lower bounds only)."""

from __future__ import annotations

import time

import httpx

from simulator.wan import WANEmulator
from tests.simulator.conftest import FAR_RTT_MS, FleetFactory, chat_body, small_topology


async def test_it_delays_health_by_the_round_trip_from_the_callers_region(
    make_fleet: FleetFactory, http: httpx.AsyncClient
) -> None:
    fleet = await make_fleet()
    url = fleet.url("node-a")  # in "near"; "far" is 200 ms away
    started = time.perf_counter()
    response = await http.get(f"{url}/health", headers={"X-Gorgo-Region": "far"})
    elapsed_ms = (time.perf_counter() - started) * 1000.0
    assert response.status_code == 200
    assert elapsed_ms >= FAR_RTT_MS


async def test_it_adds_the_round_trip_to_time_to_first_token(
    make_fleet: FleetFactory, http: httpx.AsyncClient
) -> None:
    fleet = await make_fleet()
    url = fleet.url("node-a")
    body = chat_body("Hello?", max_tokens=3, stream=True)
    started = time.perf_counter()
    first_token_ms = None
    async with http.stream(
        "POST", f"{url}/v1/chat/completions", json=body, headers={"X-Gorgo-Region": "far"}
    ) as response:
        async for line in response.aiter_lines():
            if first_token_ms is None and '"content":"' in line and '"content":""' not in line:
                first_token_ms = (time.perf_counter() - started) * 1000.0
    assert first_token_ms is not None
    assert first_token_ms >= FAR_RTT_MS


async def test_it_delays_errors_too(make_fleet: FleetFactory, http: httpx.AsyncClient) -> None:
    fleet = await make_fleet()
    started = time.perf_counter()
    response = await http.post(
        f"{fleet.url('node-a')}/v1/chat/completions",
        content=b"{not json",
        headers={"X-Gorgo-Region": "far", "Content-Type": "application/json"},
    )
    assert response.status_code == 400
    assert (time.perf_counter() - started) * 1000.0 >= FAR_RTT_MS


def test_it_splits_the_round_trip_with_seeded_additive_jitter() -> None:
    topology = small_topology()
    a = WANEmulator(topology, "node-a", "near")
    b = WANEmulator(topology, "node-a", "near")
    draws_a = [a.one_way_delays_s("far") for _ in range(50)]
    assert draws_a == [b.one_way_delays_s("far") for _ in range(50)]  # same seed, same delays
    for inbound, outbound in draws_a:
        assert FAR_RTT_MS / 2000 <= inbound <= (FAR_RTT_MS + 4.0) / 2000
        assert FAR_RTT_MS / 2000 <= outbound <= (FAR_RTT_MS + 4.0) / 2000
    assert len(set(draws_a)) > 1
    assert a.one_way_delays_s(None) == (0.0, 0.0)
    assert a.one_way_delays_s("nowhere") == (0.0, 0.0)
    assert a.one_way_delays_s("near")[0] >= 0.0005  # 1 ms within a region
