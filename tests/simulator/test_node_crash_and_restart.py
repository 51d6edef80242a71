"""Fleet.stop_node emulates a crash (connections cut, port closed); start_node restarts it cold."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.simulator.conftest import FleetFactory, chat_body
from tests.simulator.test_metrics_exposition import key, scrape


async def test_it_cuts_streams_in_flight_and_closes_the_port_on_a_crash(
    make_fleet: FleetFactory, http: httpx.AsyncClient
) -> None:
    fleet = await make_fleet(decode_step_base_ms=10.0)
    url = fleet.url("node-a")
    body = chat_body("Go on forever.", max_tokens=1000, ignore_eos=True, stream=True)

    streaming = asyncio.Event()

    async def consume() -> str:
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    streaming.set()  # a token arrived: the stream is in flight
                if "[DONE]" in line:
                    return "finished"
        return "ended without [DONE]"

    task = asyncio.create_task(consume())
    # Crash once the stream is really in flight (not after a guessed sleep); 10 s is a bound only.
    await asyncio.wait_for(streaming.wait(), timeout=10)
    await fleet.stop_node("node-a")
    with pytest.raises(httpx.HTTPError):
        await task  # the connection was dropped mid-body
    with pytest.raises(httpx.ConnectError):
        await http.get(f"{url}/health")


async def test_it_restarts_on_the_same_url_with_an_empty_cache(
    make_fleet: FleetFactory, http: httpx.AsyncClient
) -> None:
    fleet = await make_fleet()
    url = fleet.url("node-a")
    prompt = "A prompt long enough to fill a few KV blocks of sixteen tokens each, twice over " * 3
    await http.post(f"{url}/v1/chat/completions", json=chat_body(prompt, max_tokens=2))
    warm = await http.post(f"{url}/v1/chat/completions", json=chat_body(prompt, max_tokens=2))
    assert warm.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

    await fleet.stop_node("node-a")
    await fleet.start_node("node-a")
    assert fleet.url("node-a") == url
    assert (await http.get(f"{url}/health")).status_code == 200
    cold = await http.post(f"{url}/v1/chat/completions", json=chat_body(prompt, max_tokens=2))
    assert cold.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    samples = await scrape(http, url)
    assert samples[key("vllm:request_success_total", finished_reason="length")] == 1  # counters restarted


async def test_it_aborts_and_frees_a_request_whose_client_hangs_up(
    make_fleet: FleetFactory, http: httpx.AsyncClient
) -> None:
    fleet = await make_fleet(decode_step_base_ms=10.0)
    url = fleet.url("node-a")
    engine = fleet.node("node-a").engine
    assert engine is not None
    body = chat_body("Keep talking.", max_tokens=1000, ignore_eos=True, stream=True)
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        async for _ in response.aiter_lines():
            break
        assert engine.running
    for _ in range(100):  # the server notices the hang-up within a few steps (bounded: 1 s)
        if not engine.running:
            break
        await asyncio.sleep(0.01)
    assert not engine.running
    assert engine.pool.num_used == 0
    samples = await scrape(http, url)
    assert samples[key("vllm:request_success_total", finished_reason="abort")] == 1
