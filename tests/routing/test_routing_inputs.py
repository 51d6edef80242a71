"""What the gateway feeds the algorithms: prefix matches, session keys, the cache feedback loop."""

from __future__ import annotations

import asyncio

from routing.cache.approx_index import ApproxPrefixIndex
from routing.contract import GorgoParams, LeastLoadParams, RequestRecord, SessionAffinityParams, decode
from tests.routing.support import (
    MODEL,
    gateway_config,
    make_node,
    make_snapshot,
    publish,
    running_gateway,
    wait_for,
)

LONG_SYSTEM = "You are a careful assistant. " * 80  # a shared prefix of many index chunks


class RecordingIndex(ApproxPrefixIndex):
    """The real index, noting what the gateway asks of it."""

    def __init__(self) -> None:
        super().__init__()
        self.matched: list[tuple[tuple[int, ...], str]] = []
        self.inserted: list[tuple[int, str]] = []
        self.observed: list[tuple[int, float, float]] = []

    def match(self, node_ids, prompt_text):
        self.matched.append((tuple(node_ids), prompt_text))
        return super().match(node_ids, prompt_text)

    def insert(self, node_id, prompt_text):
        self.inserted.append((node_id, prompt_text))
        super().insert(node_id, prompt_text)

    def observe(self, node_id, predicted_fraction, observed_fraction, now_s):
        self.observed.append((node_id, predicted_fraction, observed_fraction))
        super().observe(node_id, predicted_fraction, observed_fraction, now_s)


def chat(user: str) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": user}],
    }


class TestRoutingInputs:
    async def test_it_asks_the_prefix_index_for_cache_aware_policies(
        self, aredis, redis_keys, redis_url, stubs
    ):
        nodes = (make_node(1, stubs[0].url), make_node(2, stubs[1].url))
        await publish(aredis, redis_keys, make_snapshot(nodes, params=GorgoParams()))
        index = RecordingIndex()
        async with running_gateway(gateway_config(redis_keys, redis_url), prefix_index=index) as gateway:
            first = await gateway.http.post("/v1/chat/completions", json=chat("What is a KV cache?"))
            second = await gateway.http.post("/v1/chat/completions", json=chat("And prefix caching?"))
        assert first.status_code == second.status_code == 200
        assert [ids for ids, _ in index.matched] == [(1, 2), (1, 2)]
        assert index.matched[0][1].startswith("<|system|>\nYou are a careful assistant.")
        assert [node for node, _ in index.inserted] == [
            int(first.headers["x-gorgo-node"].removeprefix("node-")),
            int(second.headers["x-gorgo-node"].removeprefix("node-")),
        ]
        # the shared system prompt is cached where the first request went: the second follows it
        assert second.headers["x-gorgo-node"] == first.headers["x-gorgo-node"]
        # the stub reported 32 of 42 prompt tokens cached; the gateway feeds that back
        assert index.observed and index.observed[-1][2] == 32 / 42 and index.observed[-1][1] > 0

    async def test_it_leaves_the_index_alone_for_other_policies(self, aredis, redis_keys, redis_url, stubs):
        await publish(
            aredis, redis_keys, make_snapshot((make_node(1, stubs[0].url),), params=LeastLoadParams())
        )
        index = RecordingIndex()
        async with running_gateway(gateway_config(redis_keys, redis_url), prefix_index=index) as gateway:
            assert (await gateway.http.post("/v1/chat/completions", json=chat("hi"))).status_code == 200
        assert (index.matched, index.inserted, index.observed) == ([], [], [])

    async def test_it_sizes_the_index_from_each_snapshot(self, aredis, redis_keys, redis_url, stubs):
        node = make_node(1, stubs[0].url)
        await publish(aredis, redis_keys, make_snapshot((node,), params=GorgoParams(chars_per_token=2.0)))
        index = RecordingIndex()
        async with running_gateway(gateway_config(redis_keys, redis_url), prefix_index=index):
            assert index.chunk_tokens == 256 / 2.0
            assert index.capacity_chunks(1) == int(node.kv_capacity_tokens / index.chunk_tokens)

    async def test_it_keys_sessions_on_the_policys_header(self, aredis, redis_keys, redis_url, stubs):
        nodes = tuple(
            make_node(index + 1, stub.url, name=f"gpu-{stub.name}") for index, stub in enumerate(stubs)
        )
        params = SessionAffinityParams(session_header="X-Conversation")
        await publish(aredis, redis_keys, make_snapshot(nodes, params=params))
        async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
            placements = {}
            for session in range(12):
                headers = {"X-Conversation": f"conversation-{session}"}
                used = {
                    (
                        await gateway.http.post("/v1/chat/completions", json=chat("x"), headers=headers)
                    ).headers["x-gorgo-node"]
                    for _ in range(3)
                }
                assert len(used) == 1  # one session, one node
                placements[session] = used.pop()
        assert set(placements.values()) == {"gpu-a", "gpu-b"}  # different sessions spread

    async def test_it_estimates_prompt_tokens_with_the_policys_ratio(
        self, aredis, redis_keys, redis_url, stubs
    ):
        await publish(
            aredis,
            redis_keys,
            make_snapshot((make_node(1, stubs[0].url),), params=GorgoParams(chars_per_token=2.0)),
        )
        async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
            body = {"model": MODEL, "prompt": "x" * 1000}
            assert (await gateway.http.post("/v1/completions", json=body)).status_code == 200
            assert gateway.app.runtime.inflight.outstanding_prefill_tokens() == {1: 0}
            await wait_for(lambda: aredis.xlen(redis_keys.request_stream))
        (entry,) = await aredis.xrange(redis_keys.request_stream)
        assert b'"prompt_tokens_est":500' in entry[1][b"r"]


class TestOutstandingPrefill:
    async def test_it_counts_only_the_uncached_part_as_outstanding_prefill(
        self, aredis, redis_keys, redis_url, stubs
    ):
        await publish(aredis, redis_keys, make_snapshot((make_node(1, stubs[0].url),), params=GorgoParams()))
        async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
            await gateway.http.post("/v1/chat/completions", json=chat("first"))  # fills the index
            slow = {**chat("second"), "stub": {"delay_s": 0.5}}
            task = asyncio.create_task(gateway.http.post("/v1/chat/completions", json=slow))
            await wait_for(lambda: len(stubs[0].seen) == 2)
            in_flight = gateway.app.runtime.inflight.outstanding_prefill_tokens()[1]
            assert (await task).status_code == 200
            await wait_for(lambda: _stream_length(aredis, redis_keys, 2))
        record = decode((await aredis.xrange(redis_keys.request_stream))[-1][1][b"r"], RequestRecord)
        assert record.cost is not None and record.cost.matched_tokens > 0
        assert in_flight == record.cost.uncached_tokens < record.prompt_tokens_est


def _stream_length(aredis, keys, count):
    async def check():
        return await aredis.xlen(keys.request_stream) >= count

    return check
