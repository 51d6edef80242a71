"""The request record's cost terms carry the prefix index's prediction, through a real gateway.

A gateway with a cache-aware policy in front of an emulated vLLM node: a repeated prompt must be
logged with the index's matched tokens (the dashboard's cache panel reads them), and the node's
real cache hit beside them.
"""

from __future__ import annotations

import pytest

from routing.contract import GorgoParams, PrefixAffinityParams, RequestRecord, decode
from simulator.fleet import Fleet
from simulator.topology import DEFAULT_TOPOLOGY_PATH, load_topology
from tests.routing.support import (
    MODEL,
    gateway_config,
    make_node,
    make_snapshot,
    publish,
    running_gateway,
    wait_for,
)

SYSTEM_PROMPT = "You answer questions about the gorgo routing gateway. " * 80  # ~4,300 characters


async def records(aredis, keys) -> list[RequestRecord]:
    return [decode(fields[b"r"], RequestRecord) for _, fields in await aredis.xrange(keys.request_stream)]


@pytest.mark.parametrize("params", [GorgoParams(), PrefixAffinityParams()], ids=["gorgo", "prefix_affinity"])
async def test_it_logs_the_index_prediction_for_a_repeated_prefix(aredis, redis_keys, redis_url, params):
    topology = load_topology(DEFAULT_TOPOLOGY_PATH)
    async with Fleet.start(topology, auto_ports=True, only=["us-east-1"]) as fleet:
        await publish(
            aredis, redis_keys, make_snapshot((make_node(1, fleet.url("us-east-1")),), params=params)
        )
        async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
            for question in ("What is a policy?", "What is a node?", "What is a region?"):
                body = {
                    "model": MODEL,
                    "max_tokens": 4,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    "messages": [
                        {"role": "system", "content": SYSTEM_PROMPT},
                        {"role": "user", "content": question},
                    ],
                }
                async with gateway.http.stream("POST", "/v1/chat/completions", json=body) as response:
                    assert response.status_code == 200
                    await response.aread()

            async def all_logged() -> bool:
                return await aredis.xlen(redis_keys.request_stream) >= 3

            await wait_for(all_logged)
    first, *repeats = await records(aredis, redis_keys)
    assert first.cost is not None and first.cost.matched_tokens == 0
    assert first.cost.uncached_tokens == first.prompt_tokens_est
    for record in repeats:
        assert record.status == 200 and record.cost is not None
        # The shared system prompt: ~1,070 estimated tokens of ~1,080, rounded down to chunks.
        assert record.cost.matched_tokens >= 0.9 * len(SYSTEM_PROMPT) / 4
        assert record.cost.uncached_tokens == record.prompt_tokens_est - record.cost.matched_tokens
        assert record.cached_tokens is not None and record.cached_tokens > 0.8 * record.prompt_tokens
