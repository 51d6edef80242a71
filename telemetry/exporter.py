"""What telemetry exports to Prometheus: node health, the RTT matrix and how far the workers lag
(registered with core's ``exports_metrics``, ``controlplane/metrics.py``).

Read at scrape time from what the workers keep anyway: the live node state and RTT table in Redis,
and the request stream's consumer group (how far aggregation lags behind the gateways).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from datetime import UTC, datetime

import redis
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from controlplane.connections import redis_client, redis_keys
from controlplane.fleet.models import Node
from controlplane.histogram import add_to_histogram
from controlplane.metrics import exports_metrics
from telemetry.aggregation import prediction_quality
from telemetry.choices import ResolutionChoices, ScopeChoices
from telemetry.live import read_live_state
from telemetry.models import RequestAggregate

log = logging.getLogger(__name__)

# The prediction-quality gauges cover the last five minutes of 10 s buckets: long enough for a
# median over a few hundred requests, short enough that an alert's ``for`` is what smooths.
PREDICTION_WINDOW_S = 300


@exports_metrics
def telemetry_metrics() -> Iterator[Metric]:
    nodes = {
        node.pk: (node.name, node.region.slug, node.state)
        for node in Node.objects.select_related("region").order_by("pk")
    }
    client, keys = redis_client(), redis_keys()
    live = read_live_state(client, keys)
    redis_up, stream = 0, None
    if not live.error:
        try:
            stream = _request_stream_backlog(client, keys.request_stream, keys.request_group)
            redis_up = 1
        except redis.RedisError as exc:
            log.warning("metrics: request stream unreadable: %s", exc)
    yield GaugeMetricFamily(
        "gorgo_controlplane_redis_up", "1 when the control plane could read Redis.", value=redis_up
    )
    yield from _node_families(nodes, live.nodes)
    yield from _rtt_families(nodes, live.rtt)
    yield from _prediction_families(nodes, time.time())
    if stream is not None:
        lag, pending = stream
        yield GaugeMetricFamily(
            "gorgo_telemetry_request_stream_lag",
            "Request records the gateways wrote that aggregation has not read yet.",
            value=lag,
        )
        yield GaugeMetricFamily(
            "gorgo_telemetry_request_stream_pending",
            "Request records read by aggregation and not yet acknowledged.",
            value=pending,
        )


def _request_stream_backlog(client: redis.Redis, stream: str, group: str) -> tuple[int, int]:
    """(records not read yet, records read and not acknowledged) by the aggregation's group."""
    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError:
        return 0, 0  # no stream yet: no gateway has logged a request
    for info in groups:
        name = info.get("name")
        if (name.decode() if isinstance(name, bytes) else name) == group:
            # Redis answers lag nil when it cannot tell (entries deleted mid-range): count it as 0
            # rather than invent a number; pending is always known.
            return int(info.get("lag") or 0), int(info.get("pending") or 0)
    return int(client.xlen(stream)), 0  # aggregation never ran: every record waits


def _node_families(nodes: dict[int, tuple[str, str, str]], live: dict) -> Iterator[Metric]:
    healthy = GaugeMetricFamily(
        "gorgo_node_healthy",
        "1 healthy, 0 unhealthy, as the workers' hysteresis judges the node; state is the operator's.",
        labels=["node", "region", "state"],
    )
    probed = GaugeMetricFamily(
        "gorgo_telemetry_last_probe_timestamp_seconds",
        "When a probe of the node last succeeded (unix seconds).",
        labels=["node", "region"],
    )
    scraped = GaugeMetricFamily(
        "gorgo_telemetry_last_scrape_timestamp_seconds",
        "When the node's /metrics was last scraped successfully (unix seconds).",
        labels=["node", "region"],
    )
    for node_id, (name, region, state) in nodes.items():
        doc = live.get(node_id)
        if doc is None:
            continue  # never measured: no series rather than a made-up zero
        healthy.add_metric([name, region, state], 1 if doc.healthy else 0)
        if doc.last_probe_at:
            probed.add_metric([name, region], doc.last_probe_at)
        if doc.last_scrape_at:
            scraped.add_metric([name, region], doc.last_scrape_at)
    yield from (healthy, probed, scraped)


def _rtt_families(nodes: dict[int, tuple[str, str, str]], rtt) -> Iterator[Metric]:
    round_trip = GaugeMetricFamily(
        "gorgo_rtt_seconds",
        "Application-level round trip from a region to a node (EWMA of the probes).",
        labels=["region", "node", "node_region"],
    )
    jitter = GaugeMetricFamily(
        "gorgo_rtt_jitter_seconds",
        "Mean deviation of that round trip.",
        labels=["region", "node", "node_region"],
    )
    updated = GaugeMetricFamily(
        "gorgo_rtt_updated_timestamp_seconds",
        "When that round trip was last measured (unix seconds).",
        labels=["region", "node", "node_region"],
    )
    for entry in rtt.entries if rtt is not None else ():
        if entry.node_id not in nodes:
            continue
        name, node_region, _state = nodes[entry.node_id]
        labels = [entry.region, name, node_region]
        round_trip.add_metric(labels, entry.rtt_ms / 1000.0)
        jitter.add_metric(labels, entry.jitter_ms / 1000.0)
        updated.add_metric(labels, entry.updated_at)
    yield from (round_trip, jitter, updated)


def _prediction_families(nodes: dict[int, tuple[str, str, str]], now_s: float) -> Iterator[Metric]:
    """Per node, the cost model's predicted TTFT against the measured one over the last window."""
    rows = RequestAggregate.objects.filter(
        resolution=ResolutionChoices.TEN_SECONDS,
        scope=ScopeChoices.NODE,
        bucket_start__gte=datetime.fromtimestamp(now_s - PREDICTION_WINDOW_S, tz=UTC),
        prediction_count__gt=0,
    ).values_list(
        "node_id",
        "prediction_count",
        "prediction_error_sum_ms",
        "prediction_abs_error_sum_ms",
        "prediction_error_histogram",
    )
    merged: dict[int, list] = {}
    for node_id, count, error_sum, abs_sum, histogram in rows:
        acc = merged.setdefault(node_id, [0, 0.0, 0.0, {}])
        acc[0] += count
        acc[1] += error_sum
        acc[2] += abs_sum
        add_to_histogram(acc[3], histogram or {})
    median = GaugeMetricFamily(
        "gorgo_ttft_prediction_abs_error_median_seconds",
        "Median |measured - predicted| TTFT of the node's requests over the last 5 minutes "
        "(predicted: the decision's cost terms, gateway + rtt + queue + prefill).",
        labels=["node", "region"],
    )
    bias = GaugeMetricFamily(
        "gorgo_ttft_prediction_bias_seconds",
        "Mean measured - predicted TTFT over the last 5 minutes (> 0: the model predicts too little).",
        labels=["node", "region"],
    )
    samples = GaugeMetricFamily(
        "gorgo_ttft_prediction_samples",
        "Requests with a measured and a predicted TTFT behind those figures.",
        labels=["node", "region"],
    )
    for node_id, (count, error_sum, abs_sum, histogram) in merged.items():
        if node_id not in nodes:
            continue
        quality = prediction_quality(count, error_sum, abs_sum, histogram)
        if quality is None:
            continue
        name, region, _state = nodes[node_id]
        if quality.median_abs_error_ms is not None:
            median.add_metric([name, region], quality.median_abs_error_ms / 1000.0)
        bias.add_metric([name, region], quality.bias_ms / 1000.0)
        samples.add_metric([name, region], quality.count)
    yield from (median, bias, samples)
