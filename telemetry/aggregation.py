"""Request-log aggregation: the gateways' request stream -> per-node and per-region time buckets.

Delivery is at-least-once: entries are read through a consumer group (XREADGROUP), added to the
buckets, and acknowledged (XACK) only after the database transaction committed. Entries a dead
worker left pending are taken over with XAUTOCLAIM. An entry can therefore arrive twice; the
transaction that adds it also inserts its stream id into ``ProcessedRequestEntry`` (unique), and
ids already there are skipped, so replaying entries never counts them twice.

TTFT breakdown, per record with a first token (all in ms):

    ttft = gateway + network + queue + prefill + other

- gateway: ``record.gateway_ms`` (arrival at the gateway -> request sent to the node);
- network: the round trip gateway region -> node: ``record.cost.rtt_ms`` when the algorithm
  priced it, else the live RTT table's EWMA for (gateway region, node);
- queue, prefill: the node's own ``vllm:request_queue_time_seconds`` and
  ``vllm:request_prefill_time_seconds`` means over the scrape interval in which the request
  finished (vLLM observes both when a request finishes);
- other: the remainder (tokenisation and detokenisation in the vLLM API server, the first decode
  step, relaying the first chunk back through the gateway).

Network, queue and prefill are estimates from elsewhere; each request bounds them by what its own
TTFT leaves after the gateway time (``_within_ttft``: its round trip, queueing and prefill all
happened inside its TTFT), so "other" is never negative.

Prediction quality, per record whose algorithm priced the chosen node: error = measured TTFT -
``predicted_ttft_ms(record)`` (gateway time + the cost terms rtt + queue + prefill), summed (bias),
summed as |error|, and counted in a signed log-bucketed histogram (``controlplane.histogram``), so a
window's median |error| and error quantiles come from merged buckets.

The measured parts explain the mean TTFT of a bucket when ``|other| <= max(TOLERANCE_ABS_MS,
TOLERANCE_REL * mean TTFT)`` (``within_tolerance``). Queue and prefill are node means, not the
request's own values, so single requests can be off; a bucket's mean is what the tolerance is
stated for.
"""

from __future__ import annotations

import bisect
import logging
import math
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import msgspec
import redis
from django.db import transaction
from django.utils import timezone

from controlplane.fleet.models import Node, Region
from controlplane.histogram import (
    abs_error_histogram,
    add_to_histogram,
    error_bin,
    histogram_quantile_ms,
    signed_quantile_ms,
    ttft_bin,
)
from routing import contract
from routing.contract import REQUEST_STREAM_FIELD, RedisKeys, RequestRecord, RTTTable
from telemetry.choices import RESOLUTION_SECONDS, ScopeChoices
from telemetry.groups import Breakdown
from telemetry.keyusage import add_key_usage
from telemetry.live import read_rtt_table
from telemetry.models import MetricSample, ProcessedRequestEntry, RequestAggregate
from telemetry.outcomes import client_refused, fleet_failed

log = logging.getLogger(__name__)

TOLERANCE_ABS_MS = 25.0
TOLERANCE_REL = 0.10
CLAIM_IDLE_MS = 60_000
NODE_STATS_WINDOW_S = 300.0


def breakdown_of(row: RequestAggregate) -> Breakdown | None:
    """Mean TTFT of a bucket split into its parts, with the explicit remainder."""
    if row.ttft_count == 0:
        return None
    n = row.ttft_count
    ttft = row.ttft_sum_ms / n
    parts = {
        "gateway_ms": row.gateway_sum_ms / n,
        "network_ms": row.network_sum_ms / n,
        "queue_ms": row.queue_sum_ms / n,
        "prefill_ms": row.prefill_sum_ms / n,
    }
    other = ttft - sum(parts.values())
    return Breakdown(
        ttft_mean_ms=round(ttft, 3),
        other_ms=round(other, 3),
        within_tolerance=abs(other) <= max(TOLERANCE_ABS_MS, TOLERANCE_REL * ttft),
        **{name: round(value, 3) for name, value in parts.items()},
    )


@dataclass(frozen=True, slots=True)
class PredictionQuality:
    """How far the cost model's predicted TTFT was from the measured one (error = measured - predicted)."""

    count: int
    bias_ms: float  # mean error: > 0, the model predicts too little
    mean_abs_error_ms: float
    median_abs_error_ms: float | None
    p90_abs_error_ms: float | None
    error_p10_ms: float | None
    error_p50_ms: float | None
    error_p90_ms: float | None


def prediction_quality(
    count: float, error_sum_ms: float, abs_error_sum_ms: float, histogram: dict[str, int]
) -> PredictionQuality | None:
    """A bucket's (or merged buckets') prediction quality; None without a prediction."""
    if not count:
        return None
    absolute = abs_error_histogram(histogram)
    return PredictionQuality(
        count=int(count),
        bias_ms=round(error_sum_ms / count, 3),
        mean_abs_error_ms=round(abs_error_sum_ms / count, 3),
        median_abs_error_ms=histogram_quantile_ms(absolute, 0.5),
        p90_abs_error_ms=histogram_quantile_ms(absolute, 0.9),
        error_p10_ms=signed_quantile_ms(histogram, 0.1),
        error_p50_ms=signed_quantile_ms(histogram, 0.5),
        error_p90_ms=signed_quantile_ms(histogram, 0.9),
    )


def prediction_quality_of(row: RequestAggregate) -> PredictionQuality | None:
    return prediction_quality(
        row.prediction_count,
        row.prediction_error_sum_ms,
        row.prediction_abs_error_sum_ms,
        row.prediction_error_histogram or {},
    )


# ---------------------------------------------------------------------------------------------
# Per-record contributions
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class BucketDelta:
    """What a batch adds to one bucket."""

    count: int = 0
    errors: int = 0
    client_errors: int = 0
    ttft_count: int = 0
    ttft_sum_ms: float = 0.0
    ttft_histogram: dict[str, int] = field(default_factory=dict)
    gateway_sum_ms: float = 0.0
    network_sum_ms: float = 0.0
    network_count: int = 0
    queue_sum_ms: float = 0.0
    prefill_sum_ms: float = 0.0
    node_stats_count: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_reported_prompt_tokens: int = 0  # prompt tokens of the records that reported cached_tokens
    predicted_cached_tokens: int = 0
    usage_count: int = 0
    prediction_count: int = 0
    prediction_error_sum_ms: float = 0.0
    prediction_abs_error_sum_ms: float = 0.0
    prediction_error_histogram: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Contribution:
    """One record's share of every bucket it belongs to."""

    record: RequestRecord
    network_ms: float | None
    queue_ms: float | None
    prefill_ms: float | None

    @property
    def failed(self) -> bool:
        """The fleet failed the request (``telemetry.outcomes``)."""
        return fleet_failed(self.record)

    @property
    def client_failed(self) -> bool:
        """The client's request was refused (4xx, ``telemetry.outcomes``): not the fleet's failure."""
        return client_refused(self.record)

    def add_to(self, delta: BucketDelta) -> None:
        record = self.record
        delta.count += 1
        delta.errors += int(self.failed)
        delta.client_errors += int(self.client_failed)
        if record.prompt_tokens is not None:
            delta.usage_count += 1
            delta.prompt_tokens += record.prompt_tokens
            if record.cached_tokens is not None:
                # vLLM without --enable-prompt-tokens-details reports no cached_tokens: not 0.
                delta.cached_tokens += record.cached_tokens
                delta.cached_reported_prompt_tokens += record.prompt_tokens
        else:
            delta.prompt_tokens += record.prompt_tokens_est
        if record.cost is not None:
            delta.predicted_cached_tokens += record.cost.matched_tokens
        if record.ttft_ms is None:
            return
        delta.ttft_count += 1
        delta.ttft_sum_ms += record.ttft_ms
        index = str(ttft_bin(record.ttft_ms))
        delta.ttft_histogram[index] = delta.ttft_histogram.get(index, 0) + 1
        delta.gateway_sum_ms += record.gateway_ms
        predicted = predicted_ttft_ms(record)
        if predicted is not None:
            error = record.ttft_ms - predicted
            delta.prediction_count += 1
            delta.prediction_error_sum_ms += error
            delta.prediction_abs_error_sum_ms += abs(error)
            key = error_bin(error)
            delta.prediction_error_histogram[key] = delta.prediction_error_histogram.get(key, 0) + 1
        if self.network_ms is not None:
            delta.network_sum_ms += self.network_ms
            delta.network_count += 1
        if self.queue_ms is not None and self.prefill_ms is not None:
            delta.queue_sum_ms += self.queue_ms
            delta.prefill_sum_ms += self.prefill_ms
            delta.node_stats_count += 1


def predicted_ttft_ms(record: RequestRecord) -> float | None:
    """The TTFT the router's cost model predicted for the node it chose, or None.

    Its cost terms as estimates, before the policy's weights (a weight steers the choice; it does
    not change how long the request will take): round trip + queue + prefill, plus the gateway
    time the record measured (the model leaves it out: it is the same for every node). None when
    the algorithm priced nothing (round robin, least load...) or priced another node.
    """
    cost = record.cost
    if cost is None or cost.node_id != record.node_id:
        return None
    modelled = cost.rtt_ms + cost.queue_ms + cost.prefill_ms
    if modelled <= 0:
        return None
    return record.gateway_ms + modelled


class NodeStats:
    """The scraped queue/prefill means of nodes around a batch's time span, for lookups."""

    def __init__(self, rows: Iterable[tuple[int, datetime, float | None, float, float]]) -> None:
        self._by_node: dict[int, list[tuple[float, float, float, float]]] = {}
        for node_id, ts, interval_s, queue_ms, prefill_ms in rows:
            end = ts.timestamp()
            start = end - (interval_s or 0.0)
            self._by_node.setdefault(node_id, []).append((end, start, queue_ms, prefill_ms))
        for samples in self._by_node.values():
            samples.sort()

    @classmethod
    def around(cls, node_ids: set[int], first_s: float, last_s: float) -> NodeStats:
        rows = (
            MetricSample.objects.filter(
                node_id__in=node_ids,
                ok=True,
                ts__gte=_dt(first_s - NODE_STATS_WINDOW_S),
                ts__lte=_dt(last_s + NODE_STATS_WINDOW_S),
                queue_mean_ms__isnull=False,
                prefill_mean_ms__isnull=False,
            )
            .order_by()
            .values_list("node_id", "ts", "interval_s", "queue_mean_ms", "prefill_mean_ms")
        )
        return cls(rows)

    def lookup(self, node_id: int, finished_s: float) -> tuple[float, float] | None:
        """The first scrape at or after the request finished (its interval holds the request);
        failing that (not scraped yet), the latest scrape before."""
        samples = self._by_node.get(node_id)
        if not samples:
            return None
        index = bisect.bisect_left(samples, (finished_s,))
        _end, _start, queue_ms, prefill_ms = samples[min(index, len(samples) - 1)]
        return queue_ms, prefill_ms


def _within_ttft(
    record: RequestRecord, network: float | None, queue: float | None, prefill: float | None
) -> tuple[float | None, float | None, float | None]:
    """Bound the estimated parts by what the request's own TTFT leaves for them.

    The gateway time is the request's own measurement; the network, queue and prefill parts are
    estimates from elsewhere (a probe's RTT, the node's means over a scrape interval, which hold
    other gateways' requests with longer prompts and cache misses). The request's own round trip,
    queueing and prefill all happened between leaving the gateway and its first token, so none can
    exceed ``ttft - gateway`` (and queue + prefill not what the round trip leaves): an estimate
    above that is wrong for this request, and unbounded it stacked the bar past its TTFT ("other"
    -10 to -65 ms). Queue and prefill are scaled together, keeping their ratio. The real reason is
    per request, so the bound is applied per request, before any mean.
    """
    assert record.ttft_ms is not None
    left_ms = max(record.ttft_ms - record.gateway_ms, 0.0)
    if network is not None:
        network = min(network, left_ms)
        left_ms -= network
    if queue is not None and prefill is not None and queue + prefill > left_ms:
        scale = left_ms / (queue + prefill)
        queue, prefill = queue * scale, prefill * scale
    return network, queue, prefill


def contributions(records: list[RequestRecord], rtt: RTTTable | None) -> list[Contribution]:
    node_ids = {r.node_id for r in records if r.node_id is not None and r.ttft_ms is not None}
    stats = (
        NodeStats.around(node_ids, min(r.ts for r in records), max(r.ts + r.total_ms / 1000 for r in records))
        if node_ids
        else NodeStats([])
    )
    rtt_ms = {(e.region, e.node_id): e.rtt_ms for e in rtt.entries} if rtt is not None else {}
    result = []
    for record in records:
        network = queue = prefill = None
        if record.node_id is not None and record.ttft_ms is not None:
            if record.cost is not None and record.cost.rtt_ms > 0:
                network = record.cost.rtt_ms
            else:
                network = rtt_ms.get((record.gateway_region, record.node_id))
            found = stats.lookup(record.node_id, record.ts + record.total_ms / 1000.0)
            if found is not None:
                queue, prefill = found
            network, queue, prefill = _within_ttft(record, network, queue, prefill)
        result.append(Contribution(record=record, network_ms=network, queue_ms=queue, prefill_ms=prefill))
    return result


# ---------------------------------------------------------------------------------------------
# Applying a batch
# ---------------------------------------------------------------------------------------------

BucketKey = tuple[str, str, int, datetime]  # resolution, scope, node id or region id, start


@dataclass(frozen=True, slots=True)
class BatchResult:
    """What one batch did."""

    added: int
    duplicates: int
    malformed: int
    touched: tuple[BucketKey, ...] = ()


def apply_batch(entries: list[tuple[str, RequestRecord | None]], rtt: RTTTable | None) -> BatchResult:
    """Add a batch of (stream id, record) to the buckets, each entry at most once, in one transaction."""
    malformed = sum(1 for _, record in entries if record is None)
    with transaction.atomic():
        ids = [stream_id for stream_id, record in entries if record is not None]
        seen = set(
            ProcessedRequestEntry.objects.filter(stream_id__in=ids).values_list("stream_id", flat=True)
        )
        fresh = [
            (stream_id, record)
            for stream_id, record in entries
            if record is not None and stream_id not in seen
        ]
        if not fresh:
            return BatchResult(added=0, duplicates=len(seen), malformed=malformed)
        now = timezone.now()
        ProcessedRequestEntry.objects.bulk_create(
            [
                ProcessedRequestEntry(
                    stream_id=stream_id,
                    processed_at=now,
                    request_id=record.request_id[:128],
                    ts=datetime.fromtimestamp(record.ts, tz=UTC),
                    record=contract.encode(record).decode(),
                )
                for stream_id, record in fresh
            ]
        )
        records = [record for _, record in fresh]
        deltas = _deltas(contributions(records, rtt), records)
        for key, delta in deltas.items():
            _apply_delta(key, delta)
        add_key_usage(records)
    return BatchResult(added=len(fresh), duplicates=len(seen), malformed=malformed, touched=tuple(deltas))


def _deltas(items: list[Contribution], records: list[RequestRecord]) -> dict[BucketKey, BucketDelta]:
    node_regions = dict(
        Node.objects.filter(pk__in={r.node_id for r in records if r.node_id}).values_list(
            "pk", "region__slug"
        )
    )
    regions = dict(
        Region.objects.filter(slug__in={r.gateway_region for r in records}).values_list("slug", "pk")
    )
    deltas: dict[BucketKey, BucketDelta] = {}
    for item in items:
        record = item.record
        targets = []
        if record.node_id in node_regions:
            targets.append((ScopeChoices.NODE.value, record.node_id))
        if record.gateway_region in regions:
            region_id = regions[record.gateway_region]
            targets.append((ScopeChoices.REGION.value, region_id))
            if record.node_id in node_regions:
                local = node_regions[record.node_id] == record.gateway_region
                targets.append(((ScopeChoices.LOCAL if local else ScopeChoices.CROSS).value, region_id))
        for resolution, width_s in RESOLUTION_SECONDS.items():
            start = _dt(math.floor(record.ts / width_s) * width_s)
            for scope, target_id in targets:
                item.add_to(deltas.setdefault((str(resolution), scope, target_id, start), BucketDelta()))
    return deltas


# The sums a RequestAggregate bucket keeps: what a batch adds here, and what readers that merge
# buckets (the dashboard's series) add together. The one list of them.
SUMMED_FIELDS = (
    "count",
    "errors",
    "client_errors",
    "ttft_count",
    "ttft_sum_ms",
    "gateway_sum_ms",
    "network_sum_ms",
    "network_count",
    "queue_sum_ms",
    "prefill_sum_ms",
    "node_stats_count",
    "prompt_tokens",
    "cached_tokens",
    "cached_reported_prompt_tokens",
    "predicted_cached_tokens",
    "usage_count",
    "prediction_count",
    "prediction_error_sum_ms",
    "prediction_abs_error_sum_ms",
)


def _apply_delta(key: BucketKey, delta: BucketDelta) -> RequestAggregate:
    resolution, scope, target_id, start = key
    lookup = {"resolution": resolution, "scope": scope, "bucket_start": start}
    lookup["node_id" if scope == ScopeChoices.NODE else "region_id"] = target_id
    row = RequestAggregate.objects.select_for_update().filter(**lookup).first() or RequestAggregate(**lookup)
    for name in SUMMED_FIELDS:
        setattr(row, name, getattr(row, name) + getattr(delta, name))
    histogram = add_to_histogram(dict(row.ttft_histogram or {}), delta.ttft_histogram)
    row.ttft_histogram = histogram
    if delta.prediction_error_histogram:
        row.prediction_error_histogram = add_to_histogram(
            dict(row.prediction_error_histogram or {}), delta.prediction_error_histogram
        )
    row.ttft_p50_ms = histogram_quantile_ms(histogram, 0.5)
    row.ttft_p90_ms = histogram_quantile_ms(histogram, 0.9)
    row.ttft_p99_ms = histogram_quantile_ms(histogram, 0.99)
    row.save()
    return row


# ---------------------------------------------------------------------------------------------
# The consumer
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RoundResult:
    """What one aggregation run did."""

    added: int = 0
    duplicates: int = 0
    malformed: int = 0
    claimed: int = 0
    touched: tuple[BucketKey, ...] = ()


def consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def ensure_group(client: redis.Redis, keys: RedisKeys) -> None:
    """Create the consumer group (from the stream's start, so nothing retained is skipped)."""
    try:
        client.xgroup_create(keys.request_stream, keys.request_group, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def run_round(
    client: redis.Redis,
    keys: RedisKeys,
    *,
    consumer: str | None = None,
    batch_size: int = 500,
    max_batches: int = 40,
    claim_idle_ms: int = CLAIM_IDLE_MS,
) -> RoundResult:
    """Consume what is there (bounded): own pending first, then stale pending of dead consumers, then new."""
    consumer = consumer or consumer_name()
    ensure_group(client, keys)
    rtt = read_rtt_table(client, keys)
    totals = {"added": 0, "duplicates": 0, "malformed": 0, "claimed": 0}
    touched: dict[BucketKey, None] = {}

    def consume(messages: list) -> None:
        entries = [
            (_id(stream_id), _decode(stream_id, fields))
            for stream_id, fields in messages
            if fields is not None
        ]
        stale = [_id(stream_id) for stream_id, fields in messages if fields is None]
        if entries:
            result = apply_batch(entries, rtt)
            totals["added"] += result.added
            totals["duplicates"] += result.duplicates
            totals["malformed"] += result.malformed
            touched.update(dict.fromkeys(result.touched))
        ids = [stream_id for stream_id, _ in entries] + stale
        if ids:
            client.xack(keys.request_stream, keys.request_group, *ids)

    # 1. our own pending entries (a previous run of this process failed before XACK)
    for _ in range(max_batches):
        reply = client.xreadgroup(keys.request_group, consumer, {keys.request_stream: "0"}, count=batch_size)
        messages = reply[0][1] if reply else []
        if not messages:
            break
        consume(messages)
    # 2. entries other consumers took and never acknowledged (they died)
    cursor = "0-0"
    for _ in range(max_batches):
        reply = client.xautoclaim(
            keys.request_stream,
            keys.request_group,
            consumer,
            min_idle_time=claim_idle_ms,
            start_id=cursor,
            count=batch_size,
        )
        cursor, messages = _id(reply[0]), reply[1]
        totals["claimed"] += len(messages)
        if messages:
            consume(messages)
        if cursor == "0-0":
            break
    # 3. new entries
    for _ in range(max_batches):
        reply = client.xreadgroup(keys.request_group, consumer, {keys.request_stream: ">"}, count=batch_size)
        messages = reply[0][1] if reply else []
        if not messages:
            break
        consume(messages)
    return RoundResult(touched=tuple(touched), **totals)


def forget_idle_consumers(client: redis.Redis, keys: RedisKeys, idle_ms: int = 3_600_000) -> int:
    """Remove consumers of dead worker processes (nothing pending, idle for an hour)."""
    removed = 0
    try:
        consumers = client.xinfo_consumers(keys.request_stream, keys.request_group)
    except redis.ResponseError:
        return 0
    for info in consumers:
        if info.get("pending", 0) == 0 and info.get("idle", 0) > idle_ms:
            name = info["name"]
            client.xgroup_delconsumer(keys.request_stream, keys.request_group, name)
            removed += 1
    return removed


def _decode(stream_id: bytes | str, fields: dict) -> RequestRecord | None:
    raw = fields.get(REQUEST_STREAM_FIELD.encode()) or fields.get(REQUEST_STREAM_FIELD)
    if raw is None:
        log.warning("request stream entry %s has no %r field", _id(stream_id), REQUEST_STREAM_FIELD)
        return None
    try:
        return contract.decode(raw, RequestRecord)
    except (msgspec.DecodeError, msgspec.ValidationError, contract.UnknownSchemaVersion) as exc:
        log.warning("request stream entry %s unreadable: %s", _id(stream_id), exc)
        return None


def _id(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _dt(unix_s: float) -> datetime:
    return datetime.fromtimestamp(unix_s, tz=UTC)
