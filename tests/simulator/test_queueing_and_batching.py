"""Continuous batching: a full batch makes requests wait, so TTFT rises with load; preemption recovers."""

from __future__ import annotations

import asyncio
import time

import httpx

from tests.simulator.conftest import FleetFactory, bare_engine, chat_body, run_to_end
from tests.simulator.test_metrics_exposition import key, scrape

STEP_MS = 10.0
TOKENS = 5


async def ttft_ms(http: httpx.AsyncClient, url: str, text: str) -> float:
    body = chat_body(text, max_tokens=TOKENS, ignore_eos=True, stream=True)
    started = time.perf_counter()
    first_ms: float | None = None
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if first_ms is None and '"content":"' in line and '"content":""' not in line:
                first_ms = (time.perf_counter() - started) * 1000.0
    assert first_ms is not None, "no content token"
    return first_ms


async def test_it_queues_requests_beyond_max_num_seqs_so_ttft_rises(
    make_fleet: FleetFactory, http: httpx.AsyncClient
) -> None:
    fleet = await make_fleet(max_num_seqs=1, decode_step_base_ms=STEP_MS)
    url = fleet.url("node-a")
    engine = fleet.node("node-a").engine
    assert engine is not None

    tasks = [asyncio.create_task(ttft_ms(http, url, f"Question number {i}?")) for i in range(4)]
    for _ in range(200):  # observe the queue while it exists (bounded: at most ~2 s)
        if engine.waiting:
            break
        await asyncio.sleep(0.01)
    waiting_seen = len(engine.waiting)
    samples_during = await scrape(http, url)
    ttfts = sorted(await asyncio.gather(*tasks))

    assert waiting_seen >= 1
    assert samples_during[key("vllm:num_requests_running")] == 1
    # One sequence at a time: each request waits for the previous one's TOKENS steps.
    for rank, value in enumerate(ttfts):
        assert value >= rank * TOKENS * STEP_MS * 0.9, ttfts
    after = await scrape(http, url)
    assert after[key("vllm:request_queue_time_seconds_sum")] >= 6 * TOKENS * STEP_MS / 1000 * 0.9


async def test_it_batches_concurrent_requests_when_there_is_room(
    make_fleet: FleetFactory, http: httpx.AsyncClient
) -> None:
    fleet = await make_fleet(max_num_seqs=8, decode_step_base_ms=STEP_MS)
    url = fleet.url("node-a")
    engine = fleet.node("node-a").engine
    assert engine is not None
    await asyncio.gather(*(ttft_ms(http, url, f"Batch question {i}?") for i in range(4)))
    after = await scrape(http, url)
    # Four requests of TOKENS tokens in far fewer than 4 * TOKENS steps: they shared steps.
    assert engine.steps < 4 * TOKENS
    assert after[key("vllm:request_queue_time_seconds_sum")] < 4 * TOKENS * STEP_MS / 1000


async def test_it_preempts_when_the_kv_cache_runs_out_and_still_finishes_everything() -> None:
    engine = bare_engine(kv_capacity_blocks=8, max_model_len=64, max_num_batched_tokens=256)
    # Four requests that each grow to 3 blocks cannot all fit in 8 blocks at once.
    requests = [engine.add_request(f"r{i}", [i + 1] * 17, max_tokens=30, ignore_eos=True) for i in range(4)]
    finished = await run_to_end(engine, requests)
    counts = [count for count, _ in finished]
    assert all(reason == "length" for _, reason in finished)
    assert counts == [30, 30, 30, 30]
    assert engine.num_preemptions > 0
    assert engine.pool.num_used == 0


async def test_a_preempted_request_is_not_counted_again_in_the_prefix_cache_counters() -> None:
    # vLLM 0.32 records a re-admitted preempted request's lookup apart (PrefixCacheStats.record with
    # preempted=True -> preempted_queries/_hits, v1/metrics/stats.py) and exports only the first
    # lookups as vllm:prefix_cache_queries/_hits (PrometheusStatLogger.record, v1/metrics/loggers.py).
    engine = bare_engine(kv_capacity_blocks=8, max_model_len=64, max_num_batched_tokens=256)
    # Four distinct 17-token prompts that each grow to 3 blocks: they cannot all fit in 8 blocks.
    requests = [engine.add_request(f"r{i}", [i + 1] * 17, max_tokens=30, ignore_eos=True) for i in range(4)]
    await run_to_end(engine, requests)
    labels = {"model_name": "m", "engine": "0"}
    assert engine.num_preemptions > 0
    assert engine.metrics.registry.get_sample_value("vllm:prefix_cache_queries_total", labels) == 4 * 17
    assert engine.metrics.registry.get_sample_value("vllm:prefix_cache_hits_total", labels) == 0
