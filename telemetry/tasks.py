"""Celery tasks of the telemetry app: thin, locked, and safe to run twice.

Every periodic task takes only primitives, re-reads what it needs, has soft and hard time limits,
expires when its next run is due (``CELERY_BEAT_SCHEDULE`` options, and ``expires`` on the
fanned-out probes) and holds a Redis lock (``RedisKeys.lock``, SET NX PX, TTL = hard limit) so
runs never overlap, even with several workers. The work itself is in ``rounds.py`` and
``aggregation.py``.

Queues: ``telemetry.probe_region(slug)`` runs on ``probe.<slug>`` (``route_task``), so the RTT is
measured from a worker in that region; everything else runs on the default queue. Probe workers
follow new regions without a restart, and only covered regions are probed (``probe_workers``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict

from celery import shared_task
from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.db.models import Q

from controlplane.connections import redis_client, redis_keys
from controlplane.fleet.models import Node, Region
from controlplane.locks import task_lock
from telemetry import aggregation, probe_workers, rounds
from telemetry.choices import ResolutionChoices, ScopeChoices
from telemetry.groups import AggregatesUpdate, BucketCell
from telemetry.live import forget_missing, push_dashboard
from telemetry.models import RequestAggregate
from telemetry.probes import node_http

log = logging.getLogger(__name__)

PROBE_QUEUE_PREFIX = probe_workers.PROBE_QUEUE_PREFIX
probe_queue = probe_workers.probe_queue

# (soft, hard) time limits in seconds. A round talks to every node concurrently, each call bounded
# by its own timeout, so the limits only trip on a stuck database or Redis.
FANOUT_LIMITS_S = (10, 15)
PROBE_LIMITS_S = (settings.GORGO_PROBE_TIMEOUT_S * 2 + 10, settings.GORGO_PROBE_TIMEOUT_S * 2 + 15)
SCRAPE_LIMITS_S = (settings.GORGO_SCRAPE_TIMEOUT_S * 2 + 20, settings.GORGO_SCRAPE_TIMEOUT_S * 2 + 25)
AGGREGATE_LIMITS_S = (60, 75)
PRUNE_LIMITS_S = (600, 660)


def route_task(name, args, kwargs, options, task=None, **kw):
    """Celery router (``CELERY_TASK_ROUTES``): region probes to their region's queue."""
    if name == "telemetry.probe_region":
        slug = args[0] if args else (kwargs or {}).get("region_slug")
        if slug:
            return {"queue": probe_queue(slug)}
    return None


@shared_task(
    name="telemetry.probe_fanout",
    soft_time_limit=FANOUT_LIMITS_S[0],
    time_limit=FANOUT_LIMITS_S[1],
    ignore_result=True,
)
def probe_fanout() -> int:
    """Enqueue one probe per covered region on its queue; drop live state of removed nodes.

    Returns how many probes were enqueued. A region no worker consumes gets none.
    """
    client, keys = redis_client(), redis_keys()
    with task_lock(client, keys, "probe-fanout", FANOUT_LIMITS_S[1]) as acquired:
        if not acquired:
            return 0
        slugs = list(Region.objects.order_by("slug").values_list("slug", flat=True))
        covered = probe_workers.covered_regions(client, slugs)
        for slug in slugs:
            if slug not in covered:
                log.debug("no worker probes from %s: not enqueued", slug)
                continue
            # A probe that waited longer than one interval measures nothing useful: let it expire.
            probe_region.apply_async(args=[slug], expires=settings.GORGO_PROBE_INTERVAL_S)
        forget_missing(client, keys, Node.objects.values_list("pk", flat=True), slugs)
        return len(covered)


@shared_task(
    name="telemetry.probe_region",
    soft_time_limit=PROBE_LIMITS_S[0],
    time_limit=PROBE_LIMITS_S[1],
    ignore_result=True,
)
def probe_region(region_slug: str) -> dict | None:
    """Measure the RTT from ``region_slug`` to every node (GET /health), update EWMA and health."""
    client, keys = redis_client(), redis_keys()
    with task_lock(client, keys, f"probe:{region_slug}", PROBE_LIMITS_S[1]) as acquired:
        if not acquired:
            return None
        try:
            result = rounds.probe_round(client, keys, node_http(), region_slug)
        except SoftTimeLimitExceeded:
            log.warning("probe round from %s ran out of time", region_slug)
            return None
        return asdict(result) if result is not None else None


@shared_task(
    name="telemetry.scrape_metrics",
    soft_time_limit=SCRAPE_LIMITS_S[0],
    time_limit=SCRAPE_LIMITS_S[1],
    ignore_result=True,
)
def scrape_metrics() -> dict | None:
    """Scrape every node's vLLM /metrics concurrently; store intervals, live state, health."""
    client, keys = redis_client(), redis_keys()
    with task_lock(client, keys, "scrape", SCRAPE_LIMITS_S[1]) as acquired:
        if not acquired:
            return None
        try:
            return asdict(rounds.scrape_round(client, keys, node_http()))
        except SoftTimeLimitExceeded:
            log.warning("scrape round ran out of time")
            return None


@shared_task(
    name="telemetry.aggregate_requests",
    soft_time_limit=AGGREGATE_LIMITS_S[0],
    time_limit=AGGREGATE_LIMITS_S[1],
    ignore_result=True,
)
def aggregate_requests() -> dict | None:
    """Consume the gateways' request stream into 10 s / 1 min buckets; push the changed 10 s ones."""
    client, keys = redis_client(), redis_keys()
    with task_lock(client, keys, "aggregate", AGGREGATE_LIMITS_S[1]) as acquired:
        if not acquired:
            return None
        try:
            result = aggregation.run_round(client, keys)
        except SoftTimeLimitExceeded:
            # Whatever committed is acknowledged or will be skipped as a duplicate next time.
            log.warning("aggregation round ran out of time")
            return None
        if result.touched:
            push_dashboard(_aggregates_update(result.touched))
        summary = asdict(result)
        summary["touched"] = len(result.touched)
        return summary


@shared_task(
    name="telemetry.prune",
    soft_time_limit=PRUNE_LIMITS_S[0],
    time_limit=PRUNE_LIMITS_S[1],
    ignore_result=True,
)
def prune() -> dict | None:
    """Delete samples and aggregates past their retention."""
    client, keys = redis_client(), redis_keys()
    with task_lock(client, keys, "prune", PRUNE_LIMITS_S[1]) as acquired:
        if not acquired:
            return None
        try:
            return rounds.prune(client, keys)
        except SoftTimeLimitExceeded:
            log.warning("prune ran out of time; the rest goes next run")
            return None


def _aggregates_update(touched: tuple[aggregation.BucketKey, ...]) -> AggregatesUpdate:
    wanted = Q(pk__in=[])
    for resolution, scope, target_id, start in touched:
        if resolution == ResolutionChoices.TEN_SECONDS:
            target = {"node_id" if scope == ScopeChoices.NODE else "region_id": target_id}
            wanted |= Q(resolution=resolution, scope=scope, bucket_start=start, **target)
    rows = RequestAggregate.objects.filter(wanted).select_related("region").order_by("bucket_start", "scope")
    return AggregatesUpdate(
        ts=time.time(),
        resolution=ResolutionChoices.TEN_SECONDS,
        buckets=tuple(
            BucketCell(
                scope=row.scope,
                key=str(row.node_id) if row.scope == ScopeChoices.NODE else row.region.slug,
                bucket_start=row.bucket_start.timestamp(),
                count=row.count,
                errors=row.errors,
                ttft_p50_ms=row.ttft_p50_ms,
                ttft_p90_ms=row.ttft_p90_ms,
                ttft_p99_ms=row.ttft_p99_ms,
                breakdown=aggregation.breakdown_of(row),
                prompt_tokens=row.prompt_tokens,
                cached_tokens=row.cached_tokens,
                predicted_cached_tokens=row.predicted_cached_tokens,
            )
            for row in rows
        ),
    )
