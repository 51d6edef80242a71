"""The request log: batched XADDs to a capped stream; never blocks; drops and counts on overload."""

from __future__ import annotations

import asyncio
import time

import msgspec
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

    async def test_it_builds_deferred_records_after_the_event_loop_turn(self, redis_url, redis_keys):
        client = make_redis(redis_url)
        log = RequestLog(client, redis_keys, maxlen=1000, pending_max=100, flush_interval_s=0.01)
        built: list[int] = []

        def builder(index: int):
            def build() -> RequestRecord:
                built.append(index)
                return record(index)

            return build

        for index in range(3):
            log.submit_later(builder(index))
        assert (built, log.pending) == ([], 3)  # nothing built on the request path
        await asyncio.sleep(0)  # the next turn builds the whole batch at once
        assert built == [0, 1, 2]
        log.submit_later(builder(3))
        await log.flush()  # a flush builds what the current turn left unbuilt
        entries = await client.xrange(redis_keys.request_stream)
        await client.aclose()
        assert [decode(fields[b"r"], RequestRecord).request_id for _, fields in entries] == [
            f"req-{index}" for index in range(4)
        ]
        assert (log.written, log.dropped, log.pending) == (4, 0, 0)

    async def test_a_full_queue_refuses_builders_unbuilt_and_a_failing_one_is_counted(self, redis_keys):
        dead_url = f"redis://127.0.0.1:{free_port()}/0"
        client = make_redis(dead_url)
        log = RequestLog(client, redis_keys, maxlen=10, pending_max=3, flush_interval_s=0.01)
        calls: list[int] = []

        def build_ok() -> RequestRecord:
            calls.append(1)
            return record(len(calls))

        def build_broken() -> RequestRecord:
            raise ValueError("broken record")

        log.submit(record(0))
        log.submit_later(build_broken)
        log.submit_later(build_ok)
        log.submit_later(build_ok)  # the queue holds 3: refused before it is ever built
        assert (log.pending, log.dropped) == (3, 1)
        await asyncio.sleep(0)
        assert (calls, log.pending, log.dropped) == ([1], 2, 2)
        await log.close(timeout_s=0.5)
        await client.aclose()
        assert (log.pending, log.dropped, log.written) == (0, 4, 0)


class TestRequestLogBatches:
    async def test_it_writes_each_record_whole_when_a_batch_travels_as_one_argument(
        self, redis_url, redis_keys
    ):
        # The batch goes to Redis as one buffer and the records' lengths in bytes: multi-byte
        # characters and separators inside a record must not move a boundary.
        client = make_redis(redis_url)
        log = RequestLog(client, redis_keys, maxlen=1000, pending_max=100, flush_interval_s=0.01)
        errors = ["", "é,ü 1 2 3", '日本語 " } { ,', "x" * 5000, None]
        for index, error in enumerate(errors):
            log.submit(msgspec.structs.replace(record(index), error=error))
        await log.flush()
        entries = await client.xrange(redis_keys.request_stream)
        await client.aclose()
        decoded = [decode(fields[b"r"], RequestRecord) for _, fields in entries]
        assert [(r.request_id, r.error) for r in decoded] == [
            (f"req-{index}", error) for index, error in enumerate(errors)
        ]
