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
        # The batch goes to Redis as one buffer, a record a line: multi-byte characters, line
        # breaks and separators inside a record must not move a boundary.
        client = make_redis(redis_url)
        log = RequestLog(client, redis_keys, maxlen=1000, pending_max=100, flush_interval_s=0.01)
        errors = ["", "é,ü 1 2 3", '日本語 " } { ,', "x" * 5000, None, "two\nlines\r\n", "\n"]
        for index, error in enumerate(errors):
            log.submit(msgspec.structs.replace(record(index), error=error))
        await log.flush()
        entries = await client.xrange(redis_keys.request_stream)
        await client.aclose()
        decoded = [decode(fields[b"r"], RequestRecord) for _, fields in entries]
        assert [(r.request_id, r.error) for r in decoded] == [
            (f"req-{index}", error) for index, error in enumerate(errors)
        ]


def test_the_record_carries_every_field_where_its_name_says(redis_url, redis_keys) -> None:
    """``RequestOutcome._record`` builds the record positionally (msgspec's keyword matching costs
    ~2.7 us a record): every field gets a distinct value here, and each must land under its name."""
    from routing.algorithms import REGISTRY
    from routing.algorithms.base import Decision
    from routing.cache.approx_index import ApproxPrefixIndex, chunk_hashes
    from routing.cache.prompt import parse_body
    from routing.cache.token_ratio import CharsPerToken
    from routing.config import GatewayConfig
    from routing.contract import ClientKeySpec, CostTerms, RoundRobinParams
    from routing.http.usage import PromptTokensDetails, Usage
    from routing.observability.exporter import GatewayMetrics
    from routing.proxy.exchange import Exchange
    from routing.proxy.outcome import RequestOutcome
    from routing.proxy.shadow import ShadowOutcome
    from routing.state.table import build_table
    from simulator.snapshots import MODEL, make_node, make_snapshot

    home, abroad = make_node(11, region="us-east"), make_node(12, region="eu-central")
    snapshot = make_snapshot((home, abroad), version=42, params=RoundRobinParams())
    table = build_table(snapshot, "us-east", REGISTRY, {}, {})
    prompt = "a shared system prompt that is longer than one chunk of the index " * 8
    exchange = Exchange(arrival_s=100.0, ts=1_700_000_000.5, table=table)
    exchange.request_id = "req-distinct"
    exchange.parsed = parse_body(
        "chat", msgspec.json.encode({"model": MODEL, "messages": [{"role": "user", "content": prompt}]})
    )
    exchange.prompt_tokens_est = 131
    exchange.status = 203
    exchange.stream = True
    exchange.routing_s = 0.000017
    exchange.sent_s = 100.002
    exchange.head_s = 100.0111
    exchange.ttft_s = 0.035
    exchange.bytes_out = 4_321
    exchange.error = "a distinct error"
    live_cost = CostTerms(node_id=11, total_ms=1.0, rtt_ms=2.0, queue_ms=3.0, prefill_ms=4.0)
    exchange.decision = Decision(
        home, None, CostTerms(node_id=12, total_ms=9.0), None, (123, 456), 45.5, True
    )
    exchange.prediction = (11, "approximate", 77)
    exchange.usage = Usage(
        prompt_tokens=140, completion_tokens=19, prompt_tokens_details=PromptTokensDetails(55)
    )
    exchange.key = ClientKeySpec(id="key-distinct", secret_sha256="0" * 64, owner="o", priority="batch")
    exchange.canary_id = 5
    exchange.arm = "canary"
    shadow_cost = CostTerms(node_id=12, total_ms=6.0, rtt_ms=88.0)
    exchange.shadow = ShadowOutcome(9, abroad, shadow_cost, live_cost)
    outcome = RequestOutcome(
        GatewayConfig(region="us-east", gateway_id="gw-distinct"),
        # only _record is called: a log that never writes (compiled, the type is checked)
        RequestLog(make_redis(redis_url), redis_keys, maxlen=10, pending_max=10, flush_interval_s=1.0),
        GatewayMetrics(),
        ApproxPrefixIndex(),
        CharsPerToken(4.0),
        None,
    )
    record = outcome._record(exchange, 0.25)
    expected = RequestRecord(
        schema_version=SCHEMA_VERSION,
        request_id="req-distinct",
        ts=1_700_000_000.5,
        gateway_region="us-east",
        gateway_id="gw-distinct",
        model=MODEL,
        status=203,
        stream=True,
        node_id=11,
        node_region="us-east",
        algorithm="round_robin",
        policy_version=42,
        prompt_chars=len(exchange.parsed.prompt_text),
        prompt_tokens_est=131,
        prompt_tokens=140,
        cached_tokens=55,
        completion_tokens=19,
        routing_us=pytest.approx(17.0),
        gateway_ms=pytest.approx(2.0),
        ttft_ms=pytest.approx(35.0),
        total_ms=250.0,
        bytes_out=4_321,
        error="a distinct error",
        cost=live_cost,  # the shadow priced the live side
        runner_up=CostTerms(node_id=12, total_ms=9.0),
        prefix_index_mode="approximate",
        predicted_cached_tokens=77,
        key_id="key-distinct",
        priority="batch",
        prefix_hashes=tuple(chunk_hashes(exchange.parsed.prompt_text)),
        canary_id=5,
        arm="canary",
        shadow_id=9,
        shadow_node_id=12,
        shadow_node_region="eu-central",
        shadow_cost=shadow_cost,
        rent_ms=45.5,
        homed=True,
        head_ms=pytest.approx(9.1),
    )
    assert record.prefix_hashes  # the prompt is longer than a chunk
    for field in RequestRecord.__struct_fields__:
        assert getattr(record, field) == getattr(expected, field), field
    # A shadow that chose the live node and priced it the same: its terms are logged once.
    exchange.shadow = ShadowOutcome(9, home, live_cost, live_cost)
    record = outcome._record(exchange, 0.25)
    assert (record.shadow_node_id, record.cost, record.shadow_cost) == (11, live_cost, None)
    assert record.shadow_terms == live_cost
