"""The request log: batched XADDs to a capped stream; never blocks; drops and counts on overload."""

from __future__ import annotations

import time

import pytest

from routing.contract import SCHEMA_VERSION, RequestRecord, decode
from routing.observability.request_log import RequestLog
from routing.state.policy_store import make_redis
from simulator.harness import free_port


def record(index: int) -> RequestRecord:
    return RequestRecord(
        schema_version=SCHEMA_VERSION,
        request_id=f"req-{index}",
        ts=time.time(),
        gateway_region="us-east",
        gateway_id="gw-test",
        model="m",
        status=200,
        stream=False,
    )


class TestRequestLog:
    async def test_it_writes_records_in_order_to_the_stream(self, redis_url, redis_keys):
        client = make_redis(redis_url)
        log = RequestLog(client, redis_keys, maxlen=1000, pending_max=100, flush_interval_s=0.01)
        for index in range(5):
            log.submit(record(index))
        await log.flush()
        entries = await client.xrange(redis_keys.request_stream)
        await client.aclose()
        assert [decode(fields[b"r"], RequestRecord).request_id for _, fields in entries] == [
            f"req-{index}" for index in range(5)
        ]
        assert (log.written, log.dropped, log.pending) == (5, 0, 0)

    async def test_it_caps_the_stream(self, redis_url, redis_keys):
        client = make_redis(redis_url)
        log = RequestLog(client, redis_keys, maxlen=10, pending_max=5000, flush_interval_s=0.01)
        for index in range(2500):
            log.submit(record(index))
        await log.flush()
        length = await client.xlen(redis_keys.request_stream)
        await client.aclose()
        assert log.written == 2500
        assert length < 2500  # MAXLEN ~ trims whole macro nodes, so "about" 10, not exactly

    async def test_it_drops_and_counts_when_redis_is_down(self, redis_keys):
        dead_url = f"redis://127.0.0.1:{free_port()}/0"  # a port nobody listens on
        client = make_redis(dead_url)
        log = RequestLog(client, redis_keys, maxlen=10, pending_max=3, flush_interval_s=0.01)
        for index in range(5):
            log.submit(record(index))  # never blocks, never raises
        assert (log.pending, log.dropped) == (3, 2)
        with pytest.raises(Exception):  # noqa: B017 - whatever redis-py raises, the batch is kept
            await log.flush()
        assert (log.pending, log.dropped) == (3, 2)
        await log.close(timeout_s=0.5)
        assert (log.pending, log.dropped, log.written) == (0, 5, 0)
        await client.aclose()
