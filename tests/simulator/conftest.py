"""Fixtures for the simulator's tests: a small two-region topology and in-process fleets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest

from simulator.engine import Engine, SimRequest
from simulator.fleet import Fleet
from simulator.metrics import NodeMetrics
from simulator.topology import EngineParams, Topology, parse_topology

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
FAR_RTT_MS = 200.0

# Fast but still paced: 2 ms steps, 200k prompt tokens/s.
FAST_ENGINE: dict[str, Any] = {
    "max_model_len": 4096,
    "kv_capacity_blocks": 1024,
    "max_num_seqs": 64,
    "max_num_batched_tokens": 2048,
    "prefill_tokens_per_s": 200_000.0,
    "decode_step_base_ms": 2.0,
    "decode_per_seq_ms": 0.01,
    "natural_output_min_tokens": 8,
    "natural_output_max_tokens": 32,
}


def small_topology(**engine: Any) -> Topology:
    """Regions ``near`` and ``far`` (200 ms apart); ``node-a`` in near, ``node-b`` in far."""
    return parse_topology(
        {
            "fleet": {"name": "test", "seed": 1, "enable_prompt_tokens_details": True},
            "network": {
                "intra_region_rtt_ms": 1.0,
                "intra_region_jitter_ms": 0.0,
                "links": [{"a": "near", "b": "far", "rtt_ms": FAR_RTT_MS, "jitter_ms": 4.0}],
            },
            "engine": {**FAST_ENGINE, **engine},
            "regions": [
                {"slug": "near", "name": "Near", "latitude": 39.0, "longitude": -77.5},
                {"slug": "far", "name": "Far", "latitude": 19.1, "longitude": 72.9},
            ],
            "nodes": [
                {"name": "node-a", "region": "near"},
                {"name": "node-b", "region": "far"},
            ],
        }
    )


FleetFactory = Callable[..., Awaitable[Fleet]]


@pytest.fixture
async def make_fleet() -> AsyncIterator[FleetFactory]:
    """Start fleets on free ports (``make_fleet(only=["node-a"], **engine_overrides)``); all are stopped afterwards."""
    started: list[Fleet] = []

    async def factory(
        *, topology: Topology | None = None, only: list[str] | None = None, **engine: Any
    ) -> Fleet:
        fleet = Fleet.start(
            topology or small_topology(), auto_ports=True, only=only or ["node-a"], engine_overrides=engine
        )
        await fleet.open()
        started.append(fleet)
        return fleet

    yield factory
    for fleet in started:
        await fleet.close()


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30.0) as client:
        yield client


def chat_body(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def bare_engine(kv_capacity_blocks: int, max_model_len: int, max_num_batched_tokens: int) -> Engine:
    """One emulated engine without HTTP, started: 16-token blocks, prefill next to instant, 0.5 ms
    steps (for the scheduler's and the KV cache's bookkeeping, not for timing)."""
    params = EngineParams(
        max_model_len=max_model_len,
        kv_capacity_blocks=kv_capacity_blocks,
        block_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=max_num_batched_tokens,
        prefill_tokens_per_s=1_000_000.0,
        decode_step_base_ms=0.5,
        decode_per_seq_ms=0.0,
    )
    metrics = NodeMetrics("m", max_model_len=max_model_len, block_size=16, num_gpu_blocks=kv_capacity_blocks)
    engine = Engine(params, metrics)
    engine.start()
    return engine


async def run_to_end(
    engine: Engine, requests: list[SimRequest], timeout_s: float = 20.0
) -> list[tuple[int, str]]:
    """Read every request's events until it finishes, then stop ``engine``: per request, how many
    events it sent and its finish reason."""

    async def drain(request: SimRequest) -> tuple[int, str]:
        count = 0
        while True:
            event = await request.channel.get()
            count += 1
            if event.finish_reason is not None:
                return count, event.finish_reason

    try:
        return await asyncio.wait_for(asyncio.gather(*(drain(r) for r in requests)), timeout=timeout_s)
    finally:
        await engine.stop()
