"""Request-stream aggregation: buckets, TTFT breakdown within tolerance, at-least-once without double counting."""

from __future__ import annotations

import math
import time
import uuid
from datetime import UTC, datetime

import pytest
import redis

from routing import contract
from routing.contract import REQUEST_STREAM_FIELD, CostTerms, RequestRecord, RTTEntry, RTTTable
from telemetry import aggregation
from telemetry.aggregation import TOLERANCE_ABS_MS, apply_batch, breakdown_of, run_round
from telemetry.models import MetricSample, ProcessedRequestEntry, RequestAggregate
from tests.telemetry.conftest import make_node, make_regions

pytestmark = pytest.mark.django_db

# A minute boundary two minutes ago: every record below falls in one 10 s and one 1 min bucket.
T0 = math.floor(time.time() / 60) * 60 - 120.0


def at(unix_s: float) -> datetime:
    return datetime.fromtimestamp(unix_s, tz=UTC)


@pytest.fixture
def fleet(tel):
    regions = make_regions("us-east", "eu-central")
    node = make_node("euc-1", regions["eu-central"], "http://127.0.0.1:9")
    # The node's scrapes: (T0, T0+5] queue 20 ms / prefill 50 ms; (T0+5, T0+10] 40 / 60.
    for end, queue_ms, prefill_ms in ((T0 + 5, 20.0, 50.0), (T0 + 10, 40.0, 60.0)):
        MetricSample.objects.create(
            node=node, ts=at(end), ok=True, interval_s=5.0, queue_mean_ms=queue_ms, prefill_mean_ms=prefill_ms
        )
    return regions, node


def record(node, *, ts: float, ttft_ms: float | None, **fields) -> RequestRecord:
    values = {
        "schema_version": contract.SCHEMA_VERSION,
        "request_id": uuid.uuid4().hex,
        "ts": ts,
        "gateway_region": "us-east",
        "gateway_id": "gw-1",
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "status": 200,
        "stream": True,
        "node_id": node.pk,
        "node_region": "eu-central",
        "gateway_ms": 2.0,
        "ttft_ms": ttft_ms,
        "total_ms": 400.0,
        "cost": CostTerms(node_id=node.pk, rtt_ms=88.0, matched_tokens=64),
        "prompt_tokens": 100,
        "cached_tokens": 48,
    }
    values.update(fields)
    return RequestRecord(**values)


def append(tel, *records: RequestRecord) -> list[str]:
    return [
        tel.client.xadd(tel.keys.request_stream, {REQUEST_STREAM_FIELD: contract.encode(r)}).decode()
        for r in records
    ]


def bucket(resolution: str, **target) -> RequestAggregate:
    scope = "node" if "node" in target or "node_id" in target else "region"
    return RequestAggregate.objects.get(resolution=resolution, **{"scope": scope, **target})


def test_the_breakdown_parts_add_up_to_the_measured_ttft(tel, fleet):
    regions, node = fleet
    # Requests that finished in the first scrape interval: 2 + 88 + 20 + 50 + 7 ms of API-server work.
    append(tel, *(record(node, ts=T0 + 1 + i * 0.5, ttft_ms=167.0 + i) for i in range(5)))

    result = run_round(tel.client, tel.keys)

    assert result.added == 5
    for target in ({"node": node}, {"region": regions["us-east"]}):
        parts = breakdown_of(bucket("10s", **target))
        assert (parts.gateway_ms, parts.network_ms, parts.queue_ms, parts.prefill_ms) == (
            2.0,
            88.0,
            20.0,
            50.0,
        )
        assert parts.ttft_mean_ms == pytest.approx(169.0)
        assert parts.other_ms == pytest.approx(9.0)
        total = parts.gateway_ms + parts.network_ms + parts.queue_ms + parts.prefill_ms + parts.other_ms
        assert total == pytest.approx(parts.ttft_mean_ms, abs=0.01)
        assert parts.within_tolerance and abs(parts.other_ms) <= TOLERANCE_ABS_MS


def test_it_uses_the_scrape_interval_in_which_the_request_finished(tel, fleet):
    _regions, node = fleet
    append(tel, record(node, ts=T0 + 5.2, ttft_ms=200.0, total_ms=300.0))  # finished at T0+5.5

    run_round(tel.client, tel.keys)

    parts = breakdown_of(bucket("10s", node=node))
    assert (parts.queue_ms, parts.prefill_ms) == (40.0, 60.0)


def test_it_takes_the_rtt_from_the_live_table_when_the_router_did_not_price_it(tel, fleet):
    _regions, node = fleet
    table = RTTTable(
        schema_version=contract.SCHEMA_VERSION,
        updated_at=T0,
        entries=(
            RTTEntry(region="us-east", node_id=node.pk, rtt_ms=91.5, jitter_ms=1.0, samples=9, updated_at=T0),
        ),
    )
    tel.client.set(tel.keys.live_rtt, contract.encode(table))
    append(tel, record(node, ts=T0 + 1, ttft_ms=170.0, cost=None, algorithm="round_robin"))

    run_round(tel.client, tel.keys)

    row = bucket("10s", node=node)
    assert breakdown_of(row).network_ms == 91.5
    assert row.network_count == 1 and row.predicted_cached_tokens == 0


def test_a_breakdown_that_leaves_too_much_unexplained_is_flagged(tel, fleet):
    _regions, node = fleet
    append(tel, record(node, ts=T0 + 1, ttft_ms=400.0))  # 240 ms nobody accounts for

    run_round(tel.client, tel.keys)

    parts = breakdown_of(bucket("10s", node=node))
    assert parts.other_ms == pytest.approx(240.0)
    assert parts.within_tolerance is False


def test_the_parts_never_overshoot_the_ttft_they_explain(tel, fleet):
    """Node means over a scrape interval (20 + 50 ms) and the RTT (88 ms) exceed what a fast
    request's TTFT (100 ms, 2 at the gateway) leaves: its own parts happened inside its TTFT, so
    they are bounded by it; "other" was -60 ms and the bar stacked past its TTFT marker."""
    _regions, node = fleet
    append(tel, *(record(node, ts=T0 + 1 + i * 0.5, ttft_ms=100.0) for i in range(4)))
    append(tel, record(node, ts=T0 + 3, ttft_ms=60.0))  # even the RTT is more than it leaves

    run_round(tel.client, tel.keys)

    parts = breakdown_of(bucket("10s", node=node))
    assert parts.other_ms >= 0.0
    assert (
        parts.gateway_ms + parts.network_ms + parts.queue_ms + parts.prefill_ms <= parts.ttft_mean_ms + 1e-6
    )
    assert parts.queue_ms / parts.prefill_ms == pytest.approx(20.0 / 50.0, rel=1e-3)  # scaled together
    assert parts.network_ms == pytest.approx((4 * 88.0 + 58.0) / 5)


def test_it_counts_requests_errors_tokens_and_ttft_quantiles_in_both_resolutions(tel, fleet):
    _regions, node = fleet
    good = [record(node, ts=T0 + 1 + i * 0.05, ttft_ms=float(i)) for i in range(1, 101)]
    failed = record(node, ts=T0 + 8, ttft_ms=None, status=502, error="upstream refused", prompt_tokens=None)
    append(tel, *good, failed)

    run_round(tel.client, tel.keys)

    for resolution in ("10s", "1m"):
        row = bucket(resolution, node=node)
        assert (row.count, row.errors, row.ttft_count) == (101, 1, 100)
        assert row.ttft_p50_ms == pytest.approx(50.0, rel=0.05)
        assert row.ttft_p99_ms == pytest.approx(99.0, rel=0.05)
        assert row.cached_tokens == 4800 and row.usage_count == 100
        assert row.prompt_tokens == 100 * 100 + failed.prompt_tokens_est
        assert row.predicted_cached_tokens == 101 * 64


def test_every_4xx_is_the_clients_mistake_not_a_fleet_failure(tel, fleet):
    """The gateway records an error text with the answers it gives itself (a 401 for a typo'd
    key): those counted as fleet failures (Overview "Error rate 13.89 %", "4xx 0.00 %")."""
    _regions, node = fleet
    refused = [
        record(node, ts=T0 + 1, ttft_ms=None, status=status, error=text, node_id=None, cost=None)
        for status, text in (
            (401, "Invalid API key."),
            (403, "The key may not use this model."),
            (404, "No route for /v1/nope."),
            (429, "Rate limit reached."),
            (400, "messages must be a list."),
            (499, "client disconnected"),
        )
    ]
    from_node = record(node, ts=T0 + 2, ttft_ms=30.0, status=400, error="node: context too long")
    broke = record(node, ts=T0 + 3, ttft_ms=40.0, status=200, error="node euc-1 stream broke (reset)")
    unavailable = record(node, ts=T0 + 4, ttft_ms=None, status=503, error="No node available.")
    append(tel, *refused, from_node, broke, unavailable, record(node, ts=T0 + 5, ttft_ms=150.0))

    run_round(tel.client, tel.keys)

    row = bucket("1m", region=fleet[0]["us-east"])
    assert (row.count, row.errors, row.client_errors) == (10, 2, 7)
    assert row.error_rate == pytest.approx(0.2) and row.client_error_rate == pytest.approx(0.7)


def test_a_node_that_reports_no_cached_tokens_has_no_hit_rate_not_zero(tel, fleet):
    # vLLM without --enable-prompt-tokens-details: usage has prompt_tokens, no cached_tokens.
    _regions, node = fleet
    silent = [record(node, ts=T0 + 1 + i * 0.1, ttft_ms=10.0, cached_tokens=None) for i in range(4)]
    append(tel, *silent)
    run_round(tel.client, tel.keys)
    row = bucket("10s", node=node)
    assert (row.prompt_tokens, row.cached_tokens, row.cached_reported_prompt_tokens) == (400, 0, 0)
    assert row.cache_hit_rate is None

    append(tel, record(node, ts=T0 + 2, ttft_ms=10.0))  # one that reports 48 of 100
    run_round(tel.client, tel.keys)
    assert bucket("10s", node=node).cache_hit_rate == 0.48


def test_replaying_the_same_entries_does_not_count_them_twice(tel, fleet):
    regions, node = fleet
    append(tel, *(record(node, ts=T0 + 1, ttft_ms=150.0) for _ in range(3)))
    entries = [
        (entry_id.decode(), contract.decode(fields[REQUEST_STREAM_FIELD.encode()], RequestRecord))
        for entry_id, fields in tel.client.xrange(tel.keys.request_stream)
    ]

    first = apply_batch(entries, None)
    again = apply_batch(entries, None)

    assert (first.added, again.added, again.duplicates) == (3, 0, 3)
    assert bucket("10s", node=node).count == 3
    assert bucket("1m", region=regions["us-east"]).count == 3


def test_a_crash_before_the_acknowledgement_is_not_double_counted(tel, fleet, monkeypatch):
    _regions, node = fleet
    append(tel, *(record(node, ts=T0 + 1, ttft_ms=150.0) for _ in range(4)))

    def crash(*args, **kwargs):
        raise redis.ConnectionError("worker died before XACK")

    with monkeypatch.context() as patched:
        patched.setattr(tel.client, "xack", crash)
        with pytest.raises(redis.ConnectionError):
            run_round(tel.client, tel.keys, consumer="worker-a")
    assert bucket("10s", node=node).count == 4  # committed
    assert tel.client.xpending(tel.keys.request_stream, tel.keys.request_group)["pending"] == 4

    # Another worker takes the dead one's entries over (XAUTOCLAIM) and must skip them.
    result = run_round(tel.client, tel.keys, consumer="worker-b", claim_idle_ms=0)

    assert (result.claimed, result.added, result.duplicates) == (4, 0, 4)
    assert bucket("10s", node=node).count == 4
    assert tel.client.xpending(tel.keys.request_stream, tel.keys.request_group)["pending"] == 0


def test_entries_left_pending_are_claimed_from_a_dead_consumer(tel, fleet):
    _regions, node = fleet
    append(tel, *(record(node, ts=T0 + 1, ttft_ms=150.0) for _ in range(2)))
    aggregation.ensure_group(tel.client, tel.keys)
    tel.client.xreadgroup(tel.keys.request_group, "dead", {tel.keys.request_stream: ">"})  # read, never acked

    result = run_round(tel.client, tel.keys, consumer="alive", claim_idle_ms=0)

    assert (result.claimed, result.added) == (2, 2)
    assert tel.client.xpending(tel.keys.request_stream, tel.keys.request_group)["pending"] == 0


def test_unreadable_entries_are_acknowledged_and_skipped(tel, fleet):
    _regions, node = fleet
    tel.client.xadd(tel.keys.request_stream, {REQUEST_STREAM_FIELD: b"{not json"})
    tel.client.xadd(tel.keys.request_stream, {"other": b"x"})
    append(tel, record(node, ts=T0 + 1, ttft_ms=150.0))

    result = run_round(tel.client, tel.keys)

    assert (result.added, result.malformed) == (1, 2)
    assert tel.client.xpending(tel.keys.request_stream, tel.keys.request_group)["pending"] == 0
    assert ProcessedRequestEntry.objects.count() == 1


def test_records_of_removed_nodes_still_count_for_their_region(tel, fleet):
    regions, node = fleet
    gone = record(node, ts=T0 + 1, ttft_ms=150.0, node_id=node.pk + 1000)

    append(tel, gone)
    run_round(tel.client, tel.keys)

    assert bucket("10s", region=regions["us-east"]).count == 1
    assert not RequestAggregate.objects.filter(scope="node").exists()


def test_it_keeps_the_clients_4xx_apart_from_the_fleets_failures(tel, fleet):
    _regions, node = fleet
    append(
        tel,
        record(node, ts=T0 + 1, ttft_ms=100.0),
        record(node, ts=T0 + 2, ttft_ms=None, status=400, prompt_tokens=None),
        record(node, ts=T0 + 3, ttft_ms=None, status=404, prompt_tokens=None),
        record(node, ts=T0 + 4, ttft_ms=None, status=503, prompt_tokens=None),
        record(node, ts=T0 + 5, ttft_ms=None, status=200, error="upstream reset", prompt_tokens=None),
    )

    run_round(tel.client, tel.keys)

    row = bucket("10s", region=fleet[0]["us-east"])
    assert (row.count, row.errors, row.client_errors) == (5, 2, 2)
    assert (row.error_rate, row.client_error_rate) == (0.4, 0.4)


def test_it_splits_a_gateway_regions_requests_into_local_and_cross_region(tel, fleet):
    regions, remote = fleet  # euc-1 is in eu-central
    near = make_node("use-1", regions["us-east"], "http://127.0.0.1:10")
    append(
        tel,
        *(record(near, ts=T0 + 1, ttft_ms=20.0, node_region="us-east") for _ in range(3)),
        *(record(remote, ts=T0 + 1, ttft_ms=200.0) for _ in range(2)),
    )

    run_round(tel.client, tel.keys)

    us_east = regions["us-east"]
    assert bucket("10s", region=us_east).count == 5
    local = RequestAggregate.objects.get(resolution="10s", scope="local", region=us_east)
    cross = RequestAggregate.objects.get(resolution="10s", scope="cross", region=us_east)
    assert (local.count, local.ttft_sum_ms, cross.count, cross.ttft_sum_ms) == (3, 60.0, 2, 400.0)


def test_twenty_typod_keys_leave_the_overview_error_rate_at_zero(tel, fleet):
    """The repro of issue 22: 20 requests with a mistyped key (the gateway's own 401s) beside a
    few served ones; the Overview's headline (the page's data) shows 0 % errors and the 4xx apart."""
    from controlplane.dashboard import series

    _regions, node = fleet
    now_s = math.floor(time.time() / 10) * 10
    start = now_s - 30.0  # inside the headline's last complete minute
    typos = [
        record(node, ts=start + i * 0.1, ttft_ms=None, status=401, error="Invalid API key.", node_id=None)
        for i in range(20)
    ]
    served = [record(node, ts=start + 3 + i * 0.1, ttft_ms=150.0) for i in range(5)]
    append(tel, *typos, *served)

    run_round(tel.client, tel.keys)

    headline = series.overview(now_s=now_s + 5)["headline"]
    assert headline["error_rate"] == 0.0
    assert headline["client_error_rate"] == pytest.approx(20 / 25)
