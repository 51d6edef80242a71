"""The control API crashes and restarts nodes of a running fleet, for demos and fault drills."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from simulator import tokenizer
from simulator.control import serve_control
from simulator.harness import free_port
from simulator.wan import WANEmulator
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


async def test_it_resets_the_fleet_to_how_a_new_process_starts_it(
    make_fleet: FleetFactory, http: httpx.AsyncClient
) -> None:
    """The routing benchmark runs policy after policy on one fleet: nothing of one run may reach
    the next (cached blocks, counters, queues, the oracle's log, warm tokenizer memos, jitter)."""
    fleet = await make_fleet(only=["node-a", "node-b"])
    fleet.record_oracle()
    port = free_port()
    runner = await serve_control(fleet, "127.0.0.1", port)
    control = f"http://127.0.0.1:{port}"
    body = {
        "model": fleet.node("node-a").model,
        "messages": [{"role": "user", "content": "Tell me about the policy manual. " * 60}],
        "max_tokens": 4,
        "stream": False,
    }
    fresh_jitter = WANEmulator(fleet.topology, "node-a", "near")
    expected_delays = [fresh_jitter.one_way_delays_s("far") for _ in range(3)]

    async def ask(node: str) -> dict[str, Any]:
        response = await http.post(f"{fleet.url(node)}/v1/chat/completions", json=body)
        assert response.status_code == 200
        return response.json()["usage"]

    async def counter(node: str, name: str) -> float:
        text = (await http.get(f"{fleet.url(node)}/metrics")).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))

    try:
        await ask("node-a")
        again = await ask("node-a")
        assert again["prompt_tokens_details"]["cached_tokens"] > 0  # the cache holds the prompt
        fleet.node("node-a").wan.one_way_delays_s("far")  # the jitter's sequence moved on
        assert fleet.oracle_ms and tokenizer.token_id.cache_info().currsize > 0
        assert await counter("node-a", "vllm:prefix_cache_queries_total") > 0

        reset = await http.post(f"{control}/reset")
        assert reset.status_code == 200
        assert all(n["up"] for n in reset.json()["nodes"])
        assert (await http.get(f"{control}/oracle")).json() == {"requests": {}, "served": {}}
        assert tokenizer.token_id.cache_info().currsize == 0
        assert tokenizer._segment_ids.cache_info().currsize == 0
        for node in ("node-a", "node-b"):
            engine = fleet.node(node).engine
            assert engine is not None and not engine.running and not engine.waiting
            assert engine.pool.usage == 0
            assert await counter(node, "vllm:prefix_cache_queries_total") == 0
            assert await counter(node, "vllm:prefix_cache_hits_total") == 0
        assert [fleet.node("node-a").wan.one_way_delays_s("far") for _ in range(3)] == expected_delays

        after = await ask("node-a")  # the same prompt again: nothing cached any more
        assert after["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        await runner.cleanup()
