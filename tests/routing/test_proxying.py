"""Chat and completions through the gateway, streaming and not, with the official openai client."""

from __future__ import annotations

import openai

from routing.cache.approx_index import ApproxPrefixIndex, chunk_hashes
from routing.contract import GorgoParams, LeastLoadParams, RequestRecord, decode
from tests.routing.support import (
    MODEL,
    gateway_config,
    make_node,
    make_snapshot,
    publish,
    running_gateway,
    wait_for,
)

MESSAGES = [{"role": "user", "content": "Hello there"}]


async def start(aredis, redis_keys, redis_url, stubs, **snapshot_kwargs):
    nodes = tuple(
        make_node(index + 1, stub.url, name=f"node-{stub.name}") for index, stub in enumerate(stubs)
    )
    await publish(aredis, redis_keys, make_snapshot(nodes, **snapshot_kwargs))
    return running_gateway(gateway_config(redis_keys, redis_url))


class TestProxying:
    async def test_it_answers_chat_and_completions_streaming_and_not(
        self, aredis, redis_keys, redis_url, stubs
    ):
        async with await start(aredis, redis_keys, redis_url, stubs) as gateway:
            client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
            chat = await client.chat.completions.create(model=MODEL, messages=MESSAGES)
            assert chat.choices[0].message.content == " w0 w1 w2"
            completion = await client.completions.create(model=MODEL, prompt="Once upon a time")
            assert completion.choices[0].text == " w0 w1 w2"
            stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
            assert (
                "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == " w0 w1 w2"
            )
            stream = await client.completions.create(model=MODEL, prompt="Once", stream=True)
            assert "".join([c.choices[0].text async for c in stream if c.choices]) == " w0 w1 w2"
            await client.close()
        assert [seen.path for stub in stubs for seen in stub.seen].count("/v1/completions") == 2

    async def test_it_forwards_the_body_bytes_unchanged(self, aredis, redis_keys, redis_url, stubs):
        body = b'{"model": "%s", "messages": [{"role": "user", "content": "x"}], "temperature": 0.25,  "seed": 7}'
        async with await start(aredis, redis_keys, redis_url, stubs) as gateway:
            response = await gateway.http.post("/v1/chat/completions", content=body % MODEL.encode())
            assert response.status_code == 200
        seen = [seen for stub in stubs for seen in stub.seen]
        assert seen[0].body["temperature"] == 0.25 and seen[0].body["seed"] == 7

    async def test_it_streams_incrementally(self, aredis, redis_keys, redis_url, stubs):
        """The first event reaches the client while the node is still producing the rest."""
        stub = {"chunks": 6, "chunk_delay_s": 0.2}
        request = {"model": MODEL, "messages": MESSAGES, "stream": True, "stub": stub}
        async with (
            await start(aredis, redis_keys, redis_url, stubs[:1]) as gateway,
            gateway.http.stream("POST", "/v1/chat/completions", json=request) as response,
        ):
            lines = response.aiter_lines()
            first = await anext(line async for line in lines if line.startswith("data:"))
            # a buffering proxy would only deliver this after the node wrote all six events
            assert stubs[0].events_written < 6 and stubs[0].streams_finished == 0
            rest = [line async for line in lines if line.startswith("data:")]
        assert " w0" in first
        assert rest[-1] == "data: [DONE]"
        assert len(rest) == 6  # five more content events and [DONE]

    async def test_it_spreads_requests_by_the_policy(self, aredis, redis_keys, redis_url, stubs):
        async with await start(aredis, redis_keys, redis_url, stubs) as gateway:
            nodes = []
            for _ in range(6):
                response = await gateway.http.post(
                    "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES}
                )
                nodes.append(response.headers["x-gorgo-node"])
        assert sorted(set(nodes)) == ["node-a", "node-b"]
        assert nodes.count("node-a") == 3  # round robin
        assert [len(stub.seen) for stub in stubs] == [3, 3]

    async def test_it_logs_one_record_per_request_with_usage(self, aredis, redis_keys, redis_url, stubs):
        async with await start(aredis, redis_keys, redis_url, stubs, params=LeastLoadParams()) as gateway:
            client = gateway.http
            await client.post(
                f"{gateway.url}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES}
            )
            stream_request = {
                "model": MODEL,
                "messages": MESSAGES,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with client.stream("POST", f"{gateway.url}/v1/chat/completions", json=stream_request) as r:
                assert [line async for line in r.aiter_lines()]
            await client.post(
                f"{gateway.url}/v1/chat/completions", json={"model": "nope", "messages": MESSAGES}
            )
            await wait_for(lambda: aredis.xlen(redis_keys.request_stream), timeout_s=5)
            await wait_for(_has(aredis, redis_keys, 3), timeout_s=5)
        entries = await aredis.xrange(redis_keys.request_stream)
        records = [decode(fields[b"r"], RequestRecord) for _, fields in entries]
        plain, streamed, unknown = records
        assert (plain.status, plain.stream, plain.model, plain.algorithm) == (200, False, MODEL, "least_load")
        assert plain.node_id in (1, 2) and plain.node_region == "us-east"
        assert (plain.prompt_tokens, plain.cached_tokens, plain.completion_tokens) == (42, 32, 3)
        assert plain.prompt_chars == len("<|user|>\nHello there\n") and plain.prompt_tokens_est > 0
        assert plain.ttft_ms is not None and plain.total_ms >= plain.ttft_ms >= plain.gateway_ms > 0
        assert plain.bytes_out > 0 and plain.policy_version == 1 and plain.gateway_id == "test-gw-us-east"
        assert streamed.stream and streamed.status == 200
        assert (streamed.prompt_tokens, streamed.cached_tokens) == (42, 32)
        assert (unknown.status, unknown.node_id, unknown.model) == (404, None, "nope")

    async def test_it_logs_the_prompts_prefix_hashes_never_its_text(
        self, aredis, redis_keys, redis_url, stubs
    ):
        # The what-if replay tells shared prefixes apart by these hashes alone; a least_load policy
        # never consults the prefix index, and the record still carries them.
        system = "You answer questions about the fleet. " * 20
        conversation = [{"role": "system", "content": system}, *MESSAGES]
        async with await start(aredis, redis_keys, redis_url, stubs, params=LeastLoadParams()) as gateway:
            for question in ("first question " * 30, "second question " * 30):  # whole chunks each
                messages = [*conversation, {"role": "user", "content": question}]
                await gateway.http.post(
                    f"{gateway.url}/v1/chat/completions", json={"model": MODEL, "messages": messages}
                )
            await wait_for(_has(aredis, redis_keys, 2), timeout_s=5)
        entries = await aredis.xrange(redis_keys.request_stream)
        first, second = (decode(fields[b"r"], RequestRecord) for _, fields in entries)
        assert len(first.prefix_hashes) >= 3 and len(second.prefix_hashes) >= 3
        assert first.prefix_hashes[:2] == second.prefix_hashes[:2]  # the shared system prompt
        assert first.prefix_hashes[-1] != second.prefix_hashes[-1]  # the different questions
        assert all(b"fleet" not in fields[b"r"] for _, fields in entries)

    async def test_the_record_keeps_the_hashes_the_index_routed_on(
        self, aredis, redis_keys, redis_url, stubs
    ):
        # A cache-aware policy hashes the prompt for the index; the record must reuse those hashes
        # (issue 23: a shadow that needs the index pays no second hashing). This index names its
        # chunks its own way, so a record hashed again would show the standard names instead.
        class OwnNames(ApproxPrefixIndex):
            def text_hashes(self, prompt_text):
                return [value ^ 1 for value in super().text_hashes(prompt_text)]

        question = [{"role": "user", "content": "a question of several chunks " * 40}]
        nodes = tuple(make_node(index + 1, stub.url) for index, stub in enumerate(stubs))
        await publish(aredis, redis_keys, make_snapshot(nodes, params=GorgoParams()))
        index = OwnNames()
        async with running_gateway(gateway_config(redis_keys, redis_url), prefix_index=index) as gateway:
            response = await gateway.http.post(
                f"{gateway.url}/v1/chat/completions", json={"model": MODEL, "messages": question}
            )
            assert response.status_code == 200
            await wait_for(_has(aredis, redis_keys, 1), timeout_s=5)
        ((_, fields),) = await aredis.xrange(redis_keys.request_stream)
        record = decode(fields[b"r"], RequestRecord)
        standard = chunk_hashes(index._last_text)
        assert len(standard) >= 3
        assert list(record.prefix_hashes) == [value ^ 1 for value in standard]


def _has(aredis, keys, count):
    async def check():
        return await aredis.xlen(keys.request_stream) >= count

    return check
