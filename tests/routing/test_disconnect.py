"""A client that hangs up cancels its request upstream, and the gateway forgets it."""

from __future__ import annotations

import asyncio

from routing.contract import RequestRecord, decode
from tests.routing.support import (
    MODEL,
    gateway_config,
    make_node,
    make_snapshot,
    publish,
    running_gateway,
    wait_for,
)

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


async def records(aredis, keys) -> list[RequestRecord]:
    return [decode(fields[b"r"], RequestRecord) for _, fields in await aredis.xrange(keys.request_stream)]


async def cancelled_at_the_node(aredis, keys, gateway, stub) -> RequestRecord:
    """The node saw the gateway hang up, its slot was freed, and the request was recorded as gone."""
    await wait_for(lambda: stub.aborted == 1)
    inflight = gateway.app.runtime.inflight
    await wait_for(lambda: inflight.outstanding_requests() == {1: 0})
    await wait_for(lambda: _count(aredis, keys, 1))
    (record,) = await records(aredis, keys)
    assert record.status == 499 and record.error == "client disconnected"
    return record


class TestDisconnect:
    async def test_it_cancels_the_upstream_stream_when_the_client_leaves(
        self, aredis, redis_keys, redis_url, stubs
    ):
        await publish(aredis, redis_keys, make_snapshot((make_node(1, stubs[0].url),)))
        request = {**BODY, "stream": True, "stub": {"chunks": 100, "chunk_delay_s": 0.05}}
        async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
            client = gateway.http
            async with client.stream("POST", f"{gateway.url}/v1/chat/completions", json=request) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data:"):
                        break  # one event, then hang up
            record = await cancelled_at_the_node(aredis, redis_keys, gateway, stubs[0])
        assert record.ttft_ms is not None

    async def test_it_records_a_complete_stream_as_200_when_the_client_hangs_up_after_done(
        self, aredis, redis_keys, redis_url, stubs
    ):
        # OpenAI clients stop reading at `data: [DONE]` and may close the connection before the
        # gateway has read the end of the upstream body: that is a finished request, not a 499.
        await publish(aredis, redis_keys, make_snapshot((make_node(1, stubs[0].url),)))
        request = {
            **BODY,
            "stream": True,
            "stream_options": {"include_usage": True},
            "stub": {"chunks": 3, "eof_delay_s": 0.3},
        }
        async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
            async with gateway.http.stream(
                "POST", f"{gateway.url}/v1/chat/completions", json=request
            ) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line == "data: [DONE]":
                        break  # hang up at once, as the traffic generator and SDKs do
            await wait_for(lambda: _count(aredis, redis_keys, 1))
            await wait_for(lambda: stubs[0].streams_finished == 1)  # we read its body to the end
        (record,) = await records(aredis, redis_keys)
        assert record.status == 200 and record.error is None
        assert record.completion_tokens == 3  # the usage event was read: the stream counted whole

    async def test_it_cancels_a_waiting_request_when_the_client_leaves(
        self, aredis, redis_keys, redis_url, stubs
    ):
        await publish(aredis, redis_keys, make_snapshot((make_node(1, stubs[0].url),)))
        async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
            client = gateway.http
            slow = {**BODY, "stub": {"delay_s": 1.0}}
            task = asyncio.create_task(client.post(f"{gateway.url}/v1/chat/completions", json=slow))
            await wait_for(lambda: stubs[0].seen)
            await asyncio.sleep(0.1)
            task.cancel()  # closes the connection mid-request
            await asyncio.gather(task, return_exceptions=True)
            await wait_for(lambda: _count(aredis, redis_keys, 1))
            await wait_for(lambda: stubs[0].aborted == 1, timeout_s=5)
        (record,) = await records(aredis, redis_keys)
        assert record.status == 499

    async def test_it_cancels_a_stream_whose_first_event_it_waits_for_when_the_client_leaves(
        self, aredis, redis_keys, redis_url, stubs
    ):
        # The node sent the stream's head; the gateway holds it back until the first event (so a
        # node dying before that can be retried): a client that hangs up meanwhile must still
        # cancel the request at the node and free its slot, and be recorded as gone.
        await publish(aredis, redis_keys, make_snapshot((make_node(1, stubs[0].url),)))
        async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
            request = {**BODY, "stream": True, "stub": {"first_event_delay_s": 2.0}}

            async def read() -> None:
                async with gateway.http.stream("POST", f"{gateway.url}/v1/chat/completions", json=request):
                    raise AssertionError("the head came before the node's first event")

            task = asyncio.create_task(read())
            await wait_for(lambda: stubs[0].seen)
            await asyncio.sleep(0.2)
            assert not task.done()  # waiting: the node sent its head, not an event
            task.cancel()  # closes the connection mid-request
            await asyncio.gather(task, return_exceptions=True)
            record = await cancelled_at_the_node(aredis, redis_keys, gateway, stubs[0])
        assert record.ttft_ms is None


def _count(aredis, keys, count):
    async def check():
        return await aredis.xlen(keys.request_stream) >= count

    return check
