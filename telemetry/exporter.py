"""The control plane's Prometheus endpoint (``GET /metrics`` on the web process).

Everything here is read at scrape time from what the control plane already keeps: the published
policy versions (database), the live node state and RTT table the workers write (Redis), and the
request stream's consumer group (how far aggregation lags behind the gateways). Nothing is counted
on a request path, so a scrape costs two small queries and three Redis reads.

Access: with ``GORGO_METRICS_TOKEN`` set, a scrape must send ``Authorization: Bearer <token>``;
without it only loopback clients are answered (a one-machine ``make run``), everyone else gets 403.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Iterator

import redis
from django.conf import settings
from django.db.models import Count, Max
from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_GET
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controlplane.fleet.models import Node
from controlplane.policies.models import PolicyVersion
from controlplane.policies.publishing import live_version, redis_client, redis_keys
from telemetry.live import read_live_nodes, read_rtt_table

log = logging.getLogger(__name__)

LOOPBACK_ADDRESSES = frozenset({"127.0.0.1", "::1"})


class ControlPlaneCollector(Collector):
    """Scrape-time gauges and counters over the control plane's database and Redis state."""

    def describe(self) -> list[Metric]:
        return []  # only known at scrape time

    def collect(self) -> Iterator[Metric]:
        yield from self._policies()
        nodes = {
            node.pk: (node.name, node.region.slug, node.state)
            for node in Node.objects.select_related("region").order_by("pk")
        }
        client, keys = redis_client(), redis_keys()
        redis_up = 1
        try:
            live = read_live_nodes(client, keys)
            rtt = read_rtt_table(client, keys)
            stream = _request_stream_backlog(client, keys.request_stream, keys.request_group)
        except redis.RedisError as exc:
            log.warning("metrics: Redis unreadable: %s", exc)
            redis_up, live, rtt, stream = 0, {}, None, None
        yield GaugeMetricFamily(
            "gorgo_controlplane_redis_up", "1 when the control plane could read Redis.", value=redis_up
        )
        yield from _node_families(nodes, live)
        yield from _rtt_families(nodes, rtt)
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

    def _policies(self) -> Iterator[Metric]:
        live = live_version()
        yield GaugeMetricFamily(
            "gorgo_controlplane_policy_version",
            "Version of the policy snapshot the control plane last published (0: none yet).",
            value=live.number if live else 0,
        )
        published_at = live.published_at.timestamp() if live and live.published_at else 0
        yield GaugeMetricFamily(
            "gorgo_controlplane_policy_published_timestamp_seconds",
            "When that version was published (unix seconds; 0: never).",
            value=published_at,
        )
        publishes = CounterMetricFamily(
            "gorgo_controlplane_policy_publishes",
            "Policy versions published (edits, fleet-change republishes, rollbacks), by policy.",
            labels=["policy"],
        )
        rows = (
            PolicyVersion.objects.filter(published_at__isnull=False)
            .values("policy__name")
            .annotate(count=Count("pk"), last=Max("number"))
            .order_by("policy__name")
        )
        for row in rows:
            publishes.add_metric([row["policy__name"]], row["count"])
        yield publishes


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


def _registry() -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ControlPlaneCollector())
    return registry


def _allowed(request: HttpRequest) -> bool:
    token = settings.GORGO_METRICS_TOKEN
    if not token:
        return request.META.get("REMOTE_ADDR") in LOOPBACK_ADDRESSES
    scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(credentials.strip(), token)


@require_GET
def metrics_view(request: HttpRequest) -> HttpResponse:
    """Prometheus text exposition of the control plane's state."""
    if not _allowed(request):
        message = (
            "send Authorization: Bearer <GORGO_METRICS_TOKEN>"
            if settings.GORGO_METRICS_TOKEN
            else "GORGO_METRICS_TOKEN is not set: /metrics answers loopback clients only"
        )
        return HttpResponse(message + "\n", status=403, content_type="text/plain")
    return HttpResponse(generate_latest(_registry()), content_type=CONTENT_TYPE_PLAIN_0_0_4)
