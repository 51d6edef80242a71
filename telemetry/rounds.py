"""One round of each periodic job: probe, scrape, prune. The Celery tasks in ``tasks.py`` only lock
and call these, so the rounds are testable without a broker.

A round reads the fleet afresh, talks to every node concurrently, then writes in this order:
history (database), health (streaks and CAS transitions, ``telemetry.health``), live state with
the health changes folded in (Redis, one write announced once: ``settle``), dashboard pushes.
Deciding health before writing live state is what lets a round announce once: a gateway never sees
a node's fresh load figures in one announcement and its health change in the next.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
import redis
from django.conf import settings
from django.db.models import Model as DjangoModel
from django.db.models import QuerySet
from django.utils import timezone

from controlplane.fleet.choices import NodeStateChoices
from controlplane.fleet.models import Node, Region
from routing.contract import RedisKeys
from telemetry import health
from telemetry.aggregation import forget_idle_consumers
from telemetry.choices import CheckChoices, ResolutionChoices
from telemetry.groups import NodeCell, NodesUpdate, RTTCell, RTTUpdate
from telemetry.live import (
    STATE_TTL_S,
    merge_node_live,
    publish_rtt_table,
    push_dashboard,
    telemetry_keys,
    update_rtt,
)
from telemetry.models import (
    HealthEvent,
    KeyUsageAggregate,
    MetricSample,
    NodeHealth,
    ProcessedRequestEntry,
    RequestAggregate,
    RTTSample,
)
from telemetry.probes import NodeHTTP, Target
from telemetry.vllm_metrics import MetricsInterval, MetricsParseError, Scrape, interval_between, parse_metrics

log = logging.getLogger(__name__)


def monitored_nodes() -> list[Target]:
    """Nodes worth checking: every node but the disabled ones (draining nodes still serve)."""
    return [
        Target(node_id=pk, base_url=base_url.rstrip("/"))
        for pk, base_url in Node.objects.exclude(state=NodeStateChoices.DISABLED)
        .order_by("pk")
        .values_list("pk", "base_url")
    ]


def still_present(node_ids: list[int]) -> set[int]:
    """Which of these nodes still exist. A round reads the fleet, then waits up to a timeout for
    the nodes; one deleted meanwhile must not have rows written for it (its foreign key would fail
    the round's inserts, and with them every other node's results) nor its live state revived."""
    return set(Node.objects.filter(pk__in=node_ids).values_list("pk", flat=True))


def ensure_health_rows(node_ids: list[int]) -> None:
    NodeHealth.objects.bulk_create(
        [NodeHealth(node_id=node_id) for node_id in node_ids], ignore_conflicts=True
    )


def healthy_defaults(node_ids: list[int]) -> dict[int, bool]:
    states = health.health_by_node(node_ids)
    return {node_id: health.healthy_for_gateways(states.get(node_id)) for node_id in node_ids}


def settle(
    client: redis.Redis,
    keys: RedisKeys,
    check: str,
    outcomes: list[health.Outcome],
    patches: Mapping[int, Mapping[str, Any]],
    *,
    healthy_default: Mapping[int, bool],
    announce: bool,
    thresholds: health.Thresholds | None = None,
) -> list[health.Transition]:
    """The end of every round: decide health, write live state once, announce it at most once.

    ``patches`` are the round's own live fields, one per node the round checked (empty for a failed
    check); the health transitions' ``healthy`` flips are merged into them so each node's document
    is written once. Every checked node's entry is written, failed or not: its ``updated_at`` is
    what keeps its health mark in the gateways' view (they ignore an entry older than
    ``GORGO_LIVE_STALE_S``), and a Redis that lost the entry gets it back from the database's
    health (``healthy_default``). Before, a node that kept failing after its transition was
    written no more: 30 s later, or at once after Redis restarted empty, every gateway routed to
    it as unmeasured for as long as it stayed down. The write is announced when
    ``announce`` says the round changed something the gateways route on, or when health changed.
    Each transition is then pushed to the dashboard; the round pushes its own update after this.
    """
    transitions = health.record_outcomes(client, keys, check, outcomes, thresholds)
    merged = {node_id: dict(patch) for node_id, patch in patches.items()}
    for node_id, flip in health.live_patches(transitions).items():
        merged.setdefault(node_id, {}).update(flip)
    merge_node_live(
        client, keys, merged, healthy_default=healthy_default, publish=announce or bool(transitions)
    )
    health.push_transitions(transitions)
    return transitions


# ---------------------------------------------------------------------------------------------
# Probe
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProbeRound:
    region: str
    probed: int
    failed: int
    transitions: int


def probe_round(client: redis.Redis, keys: RedisKeys, http: NodeHTTP, region_slug: str) -> ProbeRound | None:
    """Probe every node from ``region_slug``; None when the region no longer exists."""
    region_id = Region.objects.filter(slug=region_slug).values_list("pk", flat=True).first()
    if region_id is None:
        return None
    targets = monitored_nodes()
    results = http.probe_all(region_slug, targets, settings.GORGO_PROBE_TIMEOUT_S)
    present = still_present([t.node_id for t in targets])
    targets = [t for t in targets if t.node_id in present]
    results = [r for r in results if r.node_id in present]
    now = time.time()
    RTTSample.objects.bulk_create(
        [
            RTTSample(
                region_id=region_id,
                node_id=r.node_id,
                ts=datetime.fromtimestamp(r.started_at, tz=UTC),
                ok=r.ok,
                rtt_ms=r.rtt_ms,
                connect_ms=r.connect_ms,
                status_code=r.status_code,
                error=r.error,
            )
            for r in results
        ]
    )
    succeeded = {r.node_id: r.rtt_ms for r in results if r.ok and r.rtt_ms is not None}
    entries = {e.node_id: e for e in update_rtt(client, keys, region_slug, succeeded, now)}
    if entries:
        publish_rtt_table(client, keys, now)
    node_ids = [t.node_id for t in targets]
    ensure_health_rows(node_ids)
    transitions = settle(
        client,
        keys,
        CheckChoices.PROBE,
        [health.Outcome(r.node_id, r.ok, r.error) for r in results],
        # A failed probe refreshes the node's entry too (``settle``): its health mark stays fresh.
        {r.node_id: {"last_probe_at": r.started_at} if r.ok else {} for r in results},
        healthy_default=healthy_defaults(node_ids),
        announce=False,  # unless health changed: the RTT table, announced already, is what moved
    )
    push_dashboard(
        RTTUpdate(
            ts=now,
            region=region_slug,
            cells=tuple(
                RTTCell(
                    node_id=r.node_id,
                    ok=r.ok,
                    rtt_ms=entries[r.node_id].rtt_ms if r.node_id in entries else None,
                    jitter_ms=entries[r.node_id].jitter_ms if r.node_id in entries else None,
                    last_ms=r.rtt_ms,
                    connect_ms=r.connect_ms,
                )
                for r in results
            ),
        )
    )
    return ProbeRound(
        region=region_slug,
        probed=len(results),
        failed=sum(1 for r in results if not r.ok),
        transitions=len(transitions),
    )


# ---------------------------------------------------------------------------------------------
# Scrape
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ScrapeRound:
    scraped: int
    failed: int
    transitions: int


def scrape_round(client: redis.Redis, keys: RedisKeys, http: NodeHTTP) -> ScrapeRound:
    """Scrape every node's /metrics, store the interval, update live state and health."""
    targets = monitored_nodes()
    if not targets:
        return ScrapeRound(scraped=0, failed=0, transitions=0)
    private = telemetry_keys(keys)
    fetched = http.fetch_all(targets, settings.GORGO_SCRAPE_TIMEOUT_S)
    present = still_present([t.node_id for t in targets])
    targets = [t for t in targets if t.node_id in present]
    fetched = [f for f in fetched if f.node_id in present]
    baselines = client.mget([private.scrape_baseline(t.node_id) for t in targets])
    node_ids = [t.node_id for t in targets]
    ensure_health_rows(node_ids)
    defaults = healthy_defaults(node_ids)

    samples: list[MetricSample] = []
    patches: dict[int, dict] = {}
    outcomes: list[health.Outcome] = []
    cells: list[NodeCell] = []
    new_baselines: dict[str, bytes] = {}
    for fetch, raw_baseline in zip(fetched, baselines, strict=True):
        error = fetch.error
        interval = None
        if fetch.text is not None:
            try:
                scrape = parse_metrics(fetch.text, fetch.fetched_at)
            except MetricsParseError as exc:
                error = f"unparseable /metrics: {exc}"
            else:
                interval = interval_between(_decode_baseline(raw_baseline), scrape)
                new_baselines[private.scrape_baseline(fetch.node_id)] = msgspec.json.encode(scrape)
        ts = datetime.fromtimestamp(fetch.fetched_at, tz=UTC)  # the end of the interval
        if interval is None:
            samples.append(MetricSample(node_id=fetch.node_id, ts=ts, ok=False, error=error[:300]))
            outcomes.append(health.Outcome(fetch.node_id, ok=False, reason=error))
            cells.append(
                NodeCell(node_id=fetch.node_id, healthy=defaults[fetch.node_id], scrape_ok=False, error=error)
            )
            patches[fetch.node_id] = {}  # refreshes its entry and health mark (``settle``)
            continue
        sample = sample_from_interval(fetch.node_id, ts, interval)
        samples.append(sample)
        outcomes.append(health.Outcome(fetch.node_id, ok=True))
        patch = {
            "num_running": sample.num_running,
            "num_waiting": sample.num_waiting,
            "kv_cache_usage": sample.kv_cache_usage,
            "last_scrape_at": fetch.fetched_at,
        }
        if sample.prefix_hit_rate is not None:  # no queries this interval: keep the last known rate
            patch["prefix_hit_rate"] = sample.prefix_hit_rate
        patches[fetch.node_id] = patch
        cells.append(_node_cell(sample, defaults[fetch.node_id]))

    MetricSample.objects.bulk_create(samples)
    if new_baselines:
        with client.pipeline(transaction=False) as pipe:
            for key, value in new_baselines.items():
                pipe.set(key, value, ex=STATE_TTL_S)
            pipe.execute()
    _update_scrape_flags(outcomes)
    transitions = settle(
        client, keys, CheckChoices.SCRAPE, outcomes, patches, healthy_default=defaults, announce=True
    )
    flipped = {t.node_id: t.current for t in transitions}
    cells = [
        msgspec.structs.replace(c, healthy=health.healthy_for_gateways(flipped[c.node_id]))
        if c.node_id in flipped
        else c
        for c in cells
    ]
    push_dashboard(NodesUpdate(ts=time.time(), nodes=tuple(cells)))
    return ScrapeRound(
        scraped=len(targets), failed=sum(1 for o in outcomes if not o.ok), transitions=len(transitions)
    )


def sample_from_interval(node_id: int, ts: datetime, interval: MetricsInterval) -> MetricSample:
    """The database row of one scrape interval."""
    return MetricSample(
        node_id=node_id,
        ts=ts,
        ok=True,
        interval_s=interval.interval_s,
        counters_reset=interval.counters_reset,
        num_running=interval.gauge("num_running"),
        num_waiting=interval.gauge("num_waiting"),
        kv_cache_usage=interval.gauge("kv_cache_usage"),
        prefix_queries_tokens=interval.deltas.get("prefix_queries"),
        prefix_hits_tokens=interval.deltas.get("prefix_hits"),
        prefix_hit_rate=interval.prefix_hit_rate,
        prompt_tokens_per_s=interval.rate_per_s("prompt_tokens"),
        generation_tokens_per_s=interval.rate_per_s("generation_tokens"),
        preemptions=interval.deltas.get("preemptions"),
        requests_finished=interval.deltas.get("requests_finished"),
        ttft_mean_ms=interval.mean_ms("ttft"),
        ttft_p50_ms=interval.quantile_ms("ttft", 0.5),
        ttft_p90_ms=interval.quantile_ms("ttft", 0.9),
        ttft_p99_ms=interval.quantile_ms("ttft", 0.99),
        queue_mean_ms=interval.mean_ms("queue"),
        prefill_mean_ms=interval.mean_ms("prefill"),
        decode_mean_ms=interval.mean_ms("decode"),
        e2e_mean_ms=interval.mean_ms("e2e"),
        itl_mean_ms=interval.mean_ms("itl"),
        latency={name: histogram.summary() for name, histogram in interval.histograms.items()},
    )


def _node_cell(sample: MetricSample, healthy: bool) -> NodeCell:
    return NodeCell(
        node_id=sample.node_id,
        healthy=healthy,
        scrape_ok=True,
        num_running=sample.num_running,
        num_waiting=sample.num_waiting,
        kv_cache_usage=sample.kv_cache_usage,
        prefix_hit_rate=sample.prefix_hit_rate,
        prompt_tokens_per_s=sample.prompt_tokens_per_s,
        generation_tokens_per_s=sample.generation_tokens_per_s,
        ttft_p50_ms=sample.ttft_p50_ms,
        queue_mean_ms=sample.queue_mean_ms,
        prefill_mean_ms=sample.prefill_mean_ms,
    )


def _decode_baseline(raw: bytes | None) -> Scrape | None:
    if raw is None:
        return None
    try:
        return msgspec.json.decode(raw, type=Scrape)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None  # written by an incompatible version: start a fresh baseline


def _update_scrape_flags(outcomes: list[health.Outcome]) -> None:
    recovered = [o.node_id for o in outcomes if o.ok]
    if recovered:
        NodeHealth.objects.filter(node_id__in=recovered, scrape_failing=True).update(
            scrape_failing=False, scrape_error=""
        )
    for outcome in outcomes:
        if not outcome.ok:
            NodeHealth.objects.filter(node_id=outcome.node_id).update(
                scrape_failing=True, scrape_error=outcome.reason[:300]
            )


# ---------------------------------------------------------------------------------------------
# Retention
# ---------------------------------------------------------------------------------------------


def prune(
    client: redis.Redis | None, keys: RedisKeys | None, *, chunk: int = 5000, max_chunks: int = 200
) -> dict[str, int]:
    """Delete history past retention: raw samples after GORGO_RAW_RETENTION_H, rollups after
    GORGO_ROLLUP_RETENTION_D. 10 s buckets count as raw, 1 min buckets and health events as rollups."""
    now = timezone.now()
    raw_cutoff = now - timedelta(hours=settings.GORGO_RAW_RETENTION_H)
    rollup_cutoff = now - timedelta(days=settings.GORGO_ROLLUP_RETENTION_D)
    plan: dict[str, QuerySet] = {
        "rtt_samples": RTTSample.objects.filter(ts__lt=raw_cutoff),
        "metric_samples": MetricSample.objects.filter(ts__lt=raw_cutoff),
        "processed_entries": ProcessedRequestEntry.objects.filter(processed_at__lt=raw_cutoff),
        "aggregates_10s": RequestAggregate.objects.filter(
            resolution=ResolutionChoices.TEN_SECONDS, bucket_start__lt=raw_cutoff
        ),
        "aggregates_1m": RequestAggregate.objects.filter(
            resolution=ResolutionChoices.ONE_MINUTE, bucket_start__lt=rollup_cutoff
        ),
        "key_usage_10s": KeyUsageAggregate.objects.filter(
            resolution=ResolutionChoices.TEN_SECONDS, bucket_start__lt=raw_cutoff
        ),
        "key_usage_1m": KeyUsageAggregate.objects.filter(
            resolution=ResolutionChoices.ONE_MINUTE, bucket_start__lt=rollup_cutoff
        ),
        "health_events": HealthEvent.objects.filter(ts__lt=rollup_cutoff),
    }
    deleted = {name: _delete_in_chunks(queryset, chunk, max_chunks) for name, queryset in plan.items()}
    if client is not None and keys is not None:
        deleted["idle_consumers"] = forget_idle_consumers(client, keys)
    return deleted


def _delete_in_chunks(queryset: QuerySet, chunk: int, max_chunks: int) -> int:
    """Delete in bounded chunks so a big backlog never holds one long lock on the table."""
    model: type[DjangoModel] = queryset.model
    total = 0
    for _ in range(max_chunks):
        ids = list(queryset.order_by().values_list("pk", flat=True)[:chunk])
        if not ids:
            break
        total += model.objects.filter(pk__in=ids).delete()[0]
    return total
