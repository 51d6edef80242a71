"""Telemetry history: RTT samples, metric samples, health state and events, request aggregates.

The latest values ("live state") live in Redis for the gateways; these tables keep history for the
dashboard and the API. Every table has an index that starts with the columns the dashboard filters
on and ends with the timestamp, so time-range queries are index scans. Deleting a node or region
never deletes its history (see ``KEPT_NAME_HELP``). Retention is enforced by the ``telemetry.prune``
task (raw: ``GORGO_RAW_RETENTION_H``, rollups: ``GORGO_ROLLUP_RETENTION_D``).
"""

from __future__ import annotations

from typing import Any

import msgspec
from django.conf import settings
from django.db import models

from telemetry.choices import CheckChoices, HealthChoices, ResolutionChoices, ScopeChoices

# History outlives the fleet: deleting a node or region keeps its rows (foreign key set to NULL)
# and writes its name here first (``telemetry.signals``), so charts and the API still say whose.
KEPT_NAME_HELP = "Kept when the node or region is deleted (the foreign key is then null)."


class KeptNamesMixin:
    """``node_label`` / ``region_label``: the object's name, or the name kept after its delete."""

    @property
    def node_label(self) -> str | None:
        return self.node.name if self.node_id is not None else (self.node_name or None)

    @property
    def region_label(self) -> str | None:
        return self.region.slug if self.region_id is not None else (self.region_slug or None)


class NodeHealth(models.Model):
    """The measured health of one node, as the hysteresis last decided it.

    Only changed by compare-and-swap (``filter(node=..., health=old).update(...)``) so that two
    workers judging the same node at once record one transition, not two.
    """

    node = models.OneToOneField("fleet.Node", on_delete=models.CASCADE, related_name="health")
    health = models.CharField(max_length=16, choices=HealthChoices.choices, default=HealthChoices.UNKNOWN)
    changed_at = models.DateTimeField(null=True, blank=True)
    reason = models.CharField(max_length=300, blank=True, help_text="Why the last transition happened.")
    scrape_failing = models.BooleanField(default=False, help_text="The last /metrics scrape failed.")
    scrape_error = models.CharField(max_length=300, blank=True)

    class Meta:
        ordering = ["node__name"]
        verbose_name_plural = "node health"

    def __str__(self) -> str:
        return f"{self.node_id}: {self.health}"


class HealthEvent(KeptNamesMixin, models.Model):
    """One health transition of a node, with the check that caused it."""

    node = models.ForeignKey(
        "fleet.Node", on_delete=models.SET_NULL, null=True, blank=True, related_name="health_events"
    )
    node_name = models.CharField(max_length=100, blank=True, help_text=KEPT_NAME_HELP)
    ts = models.DateTimeField()
    previous = models.CharField(max_length=16, choices=HealthChoices.choices)
    current = models.CharField(max_length=16, choices=HealthChoices.choices)
    source = models.CharField(
        max_length=16, choices=CheckChoices.choices, help_text="The check that decided."
    )
    reason = models.CharField(max_length=300, blank=True)

    class Meta:
        ordering = ["-ts", "-id"]
        indexes = [
            models.Index(fields=["node", "ts"], name="telemetry_health_node_ts"),
            models.Index(fields=["ts"], name="telemetry_health_ts"),
        ]

    def __str__(self) -> str:
        return f"{self.node_id} {self.previous}->{self.current} at {self.ts:%Y-%m-%d %H:%M:%S}"


class RTTSample(KeptNamesMixin, models.Model):
    """One application-level round trip (GET /health) from a region to a node.

    ``rtt_ms`` is request sent -> response headers received on an open connection; when the probe
    had to open a new connection, the TCP (and TLS) setup is in ``connect_ms``, not in ``rtt_ms``.
    """

    region = models.ForeignKey(
        "fleet.Region", on_delete=models.SET_NULL, null=True, blank=True, related_name="rtt_samples"
    )
    region_slug = models.CharField(max_length=64, blank=True, help_text=KEPT_NAME_HELP)
    node = models.ForeignKey(
        "fleet.Node", on_delete=models.SET_NULL, null=True, blank=True, related_name="rtt_samples"
    )
    node_name = models.CharField(max_length=100, blank=True, help_text=KEPT_NAME_HELP)
    ts = models.DateTimeField()
    ok = models.BooleanField()
    rtt_ms = models.FloatField(null=True, blank=True)
    connect_ms = models.FloatField(
        null=True, blank=True, help_text="Set only when a new connection was made."
    )
    status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    error = models.CharField(max_length=300, blank=True)

    class Meta:
        ordering = ["-ts", "-id"]
        indexes = [
            models.Index(fields=["node", "region", "ts"], name="telemetry_rtt_node_region_ts"),
            models.Index(fields=["region", "ts"], name="telemetry_rtt_region_ts"),
            models.Index(fields=["ts"], name="telemetry_rtt_ts"),
        ]

    def __str__(self) -> str:
        return f"{self.region_id}->{self.node_id} {self.rtt_ms} ms"


class MetricSample(KeptNamesMixin, models.Model):
    """One scrape of a node's vLLM /metrics, reduced to the interval since the previous scrape.

    Gauges are as scraped; rates, hit rate and latency figures cover (ts - interval_s, ts]. The
    first scrape of a node (or the first after its counters reset without a usable baseline) has
    gauges only. ``latency`` holds every histogram's interval summary:
    ``{"ttft": {"count": n, "mean_ms": .., "p50_ms": .., "p90_ms": .., "p99_ms": ..}, ...}``.
    """

    node = models.ForeignKey(
        "fleet.Node", on_delete=models.SET_NULL, null=True, blank=True, related_name="metric_samples"
    )
    node_name = models.CharField(max_length=100, blank=True, help_text=KEPT_NAME_HELP)
    ts = models.DateTimeField()
    ok = models.BooleanField()
    error = models.CharField(max_length=300, blank=True)
    interval_s = models.FloatField(null=True, blank=True)
    counters_reset = models.BooleanField(default=False, help_text="The node's counters went back (restart).")
    num_running = models.FloatField(null=True, blank=True)
    num_waiting = models.FloatField(null=True, blank=True)
    kv_cache_usage = models.FloatField(null=True, blank=True, help_text="0..1")
    prefix_queries_tokens = models.FloatField(null=True, blank=True)
    prefix_hits_tokens = models.FloatField(null=True, blank=True)
    prefix_hit_rate = models.FloatField(null=True, blank=True, help_text="Hits / queries in tokens, 0..1.")
    prompt_tokens_per_s = models.FloatField(null=True, blank=True)
    generation_tokens_per_s = models.FloatField(null=True, blank=True)
    preemptions = models.FloatField(null=True, blank=True)
    requests_finished = models.FloatField(null=True, blank=True)
    ttft_mean_ms = models.FloatField(null=True, blank=True)
    ttft_p50_ms = models.FloatField(null=True, blank=True)
    ttft_p90_ms = models.FloatField(null=True, blank=True)
    ttft_p99_ms = models.FloatField(null=True, blank=True)
    queue_mean_ms = models.FloatField(null=True, blank=True)
    prefill_mean_ms = models.FloatField(null=True, blank=True)
    decode_mean_ms = models.FloatField(null=True, blank=True)
    e2e_mean_ms = models.FloatField(null=True, blank=True)
    itl_mean_ms = models.FloatField(null=True, blank=True)
    latency = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-ts", "-id"]
        indexes = [
            models.Index(fields=["node", "ts"], name="telemetry_metric_node_ts"),
            models.Index(fields=["ts"], name="telemetry_metric_ts"),
        ]

    def __str__(self) -> str:
        return f"{self.node_id} at {self.ts:%Y-%m-%d %H:%M:%S}"


class RequestAggregate(KeptNamesMixin, models.Model):
    """Finished requests of one time bucket, per node or per gateway region.

    Sums, not means, so that adding a batch of records is a plain addition; means and the TTFT
    breakdown (gateway + network + queue + prefill + other = TTFT) are derived when read. The
    ``*_sum_ms`` parts are summed over the ``ttft_count`` records that had a first token;
    ``network_count`` and ``node_stats_count`` say for how many of them the RTT and the node's
    queue/prefill figures were known (unknown parts count as 0 and end up in "other").
    """

    resolution = models.CharField(max_length=4, choices=ResolutionChoices.choices)
    scope = models.CharField(max_length=8, choices=ScopeChoices.choices)
    node = models.ForeignKey(
        "fleet.Node", on_delete=models.SET_NULL, null=True, blank=True, related_name="request_aggregates"
    )
    node_name = models.CharField(max_length=100, blank=True, help_text=KEPT_NAME_HELP)
    region = models.ForeignKey(
        "fleet.Region", on_delete=models.SET_NULL, null=True, blank=True, related_name="request_aggregates"
    )
    region_slug = models.CharField(max_length=64, blank=True, help_text=KEPT_NAME_HELP)
    bucket_start = models.DateTimeField()
    count = models.PositiveIntegerField(default=0)
    errors = models.PositiveIntegerField(
        default=0, help_text="Server-side failures: 5xx answers and requests that got no answer."
    )
    client_errors = models.PositiveIntegerField(
        default=0, help_text="4xx answers: the client's own mistakes, not the fleet's."
    )
    ttft_count = models.PositiveIntegerField(default=0)
    ttft_sum_ms = models.FloatField(default=0.0)
    ttft_histogram = models.JSONField(default=dict, blank=True, help_text="Log-bucketed TTFT counts.")
    ttft_p50_ms = models.FloatField(null=True, blank=True)
    ttft_p90_ms = models.FloatField(null=True, blank=True)
    ttft_p99_ms = models.FloatField(null=True, blank=True)
    gateway_sum_ms = models.FloatField(default=0.0)
    network_sum_ms = models.FloatField(default=0.0)
    network_count = models.PositiveIntegerField(default=0)
    queue_sum_ms = models.FloatField(default=0.0)
    prefill_sum_ms = models.FloatField(default=0.0)
    node_stats_count = models.PositiveIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0, help_text="Prompt tokens routed.")
    cached_tokens = models.PositiveBigIntegerField(default=0, help_text="Prompt tokens the node had cached.")
    cached_reported_prompt_tokens = models.PositiveBigIntegerField(
        default=0,
        help_text="Prompt tokens of the requests whose node reported cached_tokens (vLLM reports "
        "them only with --enable-prompt-tokens-details): the hit rate's denominator.",
    )
    predicted_cached_tokens = models.PositiveBigIntegerField(
        default=0, help_text="Prompt tokens the router expected to be cached (cost.matched_tokens)."
    )
    usage_count = models.PositiveIntegerField(default=0, help_text="Records that carried the node's usage.")
    # Prediction quality: the router's predicted TTFT (its cost terms rtt + queue + prefill, before
    # weights) against the measured TTFT, per record that had both. Error = measured - predicted.
    prediction_count = models.PositiveIntegerField(
        default=0, help_text="Records with a measured TTFT and the cost model's predicted TTFT."
    )
    prediction_error_sum_ms = models.FloatField(
        default=0.0, help_text="Sum of measured - predicted TTFT (ms): the bias is this over the count."
    )
    prediction_abs_error_sum_ms = models.FloatField(default=0.0)
    prediction_error_histogram = models.JSONField(
        default=dict,
        blank=True,
        help_text='Log-bucketed |error| counts keyed "+bin" (measured above predicted) or "-bin".',
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-bucket_start", "scope", "node_id", "region_id"]
        constraints = [
            models.UniqueConstraint(
                fields=["resolution", "node", "bucket_start"],
                condition=models.Q(scope="node"),
                name="telemetry_aggregate_unique_node_bucket",
            ),
            models.UniqueConstraint(
                fields=["resolution", "region", "bucket_start"],
                condition=models.Q(scope="region"),
                name="telemetry_aggregate_unique_region_bucket",
            ),
            models.UniqueConstraint(
                fields=["resolution", "scope", "region", "bucket_start"],
                condition=models.Q(scope__in=["local", "cross"]),
                name="telemetry_aggregate_unique_split_bucket",
            ),
        ]
        indexes = [
            models.Index(fields=["resolution", "scope", "bucket_start"], name="telemetry_agg_res_scope_ts"),
            models.Index(fields=["node", "resolution", "bucket_start"], name="telemetry_agg_node_ts"),
            models.Index(fields=["region", "resolution", "bucket_start"], name="telemetry_agg_region_ts"),
        ]

    def __str__(self) -> str:
        target = (
            f"node {self.node_id}" if self.scope == ScopeChoices.NODE else f"{self.scope} {self.region_id}"
        )
        return f"{self.resolution} {target} at {self.bucket_start:%Y-%m-%d %H:%M:%S}"

    @property
    def error_rate(self) -> float | None:
        """Server-side failures (5xx, no answer) per request."""
        return _ratio(self.errors, self.count)

    @property
    def client_error_rate(self) -> float | None:
        """4xx answers per request."""
        return _ratio(self.client_errors, self.count)

    @property
    def network_known(self) -> float | None:
        """Share of TTFTs with a known RTT."""
        return _ratio(self.network_count, self.ttft_count)

    @property
    def node_stats_known(self) -> float | None:
        """Share of TTFTs with the node's queue/prefill figures."""
        return _ratio(self.node_stats_count, self.ttft_count)

    @property
    def cache_hit_rate(self) -> float | None:
        """cached_tokens / the prompt tokens of the requests that reported them (None: none did)."""
        return _ratio(self.cached_tokens, self.cached_reported_prompt_tokens)


def _ratio(part: float, whole: float) -> float | None:
    return round(part / whole, 4) if whole else None


class ProcessedRequestEntry(models.Model):
    """A request-stream entry already added to the aggregates, with the request record itself.

    Written in the same transaction as the bucket updates, so an entry delivered twice (a worker
    died after committing but before XACK, and XAUTOCLAIM handed it to another) is counted once.
    The record (the gateway's ``RequestRecord``, as JSON) is kept with it, so one request can be
    found by its ``x-request-id`` for as long as the raw data is (``GORGO_RAW_RETENTION_H``).
    """

    stream_id = models.CharField(max_length=40, unique=True)
    processed_at = models.DateTimeField(db_index=True)
    # The gateway's x-request-id (a client's own, up to 128 printable characters, or the gateway's).
    request_id = models.CharField(max_length=128, blank=True, db_index=True)
    ts = models.DateTimeField(null=True, blank=True, help_text="When the request reached the gateway.")
    record = models.TextField(blank=True, help_text="The RequestRecord as the gateway logged it (JSON).")

    class Meta:
        ordering = ["-processed_at"]

    def __str__(self) -> str:
        return self.stream_id

    @classmethod
    def find(cls, request_id: str) -> ProcessedRequestEntry | None:
        """The request with this x-request-id (the newest, if a client sent one id twice)."""
        if not request_id:
            return None
        return cls.objects.filter(request_id=request_id).exclude(record="").order_by("-ts", "-pk").first()

    @staticmethod
    def not_found_message(request_id: str) -> str:
        """Why a request id is not in the log: unknown, past retention, or not aggregated yet."""
        return (
            f"No request with x-request-id {request_id!r} in the request log. It keeps requests for "
            f"{settings.GORGO_RAW_RETENTION_H:g} h (GORGO_RAW_RETENTION_H), and a request appears within "
            f"an aggregation round ({settings.GORGO_AGGREGATE_INTERVAL_S:g} s) of finishing."
        )

    def decoded(self) -> dict[str, Any]:
        """The record as the gateway logged it."""
        return msgspec.json.decode(self.record) if self.record else {}


class KeyUsageAggregate(models.Model):
    """Finished requests of one time bucket made with one client key (and priority class).

    Sums like ``RequestAggregate``, read per key or summed per team. ``key_id`` is the key's public
    id as the gateway logged it (never its secret), kept even after the key is deleted; ``team`` is
    the key's team when the requests were aggregated. Status classes: ``errors_4xx`` (refused by
    the gateway or the node: bad input, auth, limits, client gone), ``errors_5xx`` (the fleet
    failed: a 5xx, or a stream that broke after its 2xx); of the 4xx, ``limited`` are 429s (rate
    limits) and ``refused`` are 401/403s (key not valid, model or region not allowed).
    """

    resolution = models.CharField(max_length=4, choices=ResolutionChoices.choices)
    bucket_start = models.DateTimeField()
    key_id = models.CharField(max_length=16, help_text="The client key's public id.")
    client_key = models.ForeignKey(
        "keys.ClientKey",
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="usage_aggregates",
        help_text="Empty when the key was deleted (or unknown when aggregated).",
    )
    team = models.CharField(max_length=100, blank=True, help_text="The key's team when aggregated.")
    priority = models.CharField(
        max_length=16, blank=True, help_text="Priority class the gateway applied (interactive, batch)."
    )
    count = models.PositiveIntegerField(default=0)
    errors_4xx = models.PositiveIntegerField(default=0)
    errors_5xx = models.PositiveIntegerField(default=0)
    limited = models.PositiveIntegerField(default=0, help_text="429: over a rate limit or queue.")
    refused = models.PositiveIntegerField(default=0, help_text="401/403: key or model/region refused.")
    prompt_tokens = models.PositiveBigIntegerField(
        default=0, help_text="The node's usage, else the gateway's estimate."
    )
    completion_tokens = models.PositiveBigIntegerField(default=0, help_text="From the node's usage.")
    cached_tokens = models.PositiveBigIntegerField(default=0, help_text="Prompt tokens the node had cached.")
    usage_count = models.PositiveIntegerField(default=0, help_text="Records that carried the node's usage.")
    ttft_count = models.PositiveIntegerField(default=0)
    ttft_sum_ms = models.FloatField(default=0.0)
    ttft_histogram = models.JSONField(default=dict, blank=True, help_text="Log-bucketed TTFT counts.")
    ttft_p50_ms = models.FloatField(null=True, blank=True)
    ttft_p99_ms = models.FloatField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-bucket_start", "key_id", "priority"]
        constraints = [
            models.UniqueConstraint(
                fields=["resolution", "key_id", "priority", "bucket_start"],
                name="telemetry_key_usage_unique_bucket",
            ),
        ]
        indexes = [
            models.Index(fields=["resolution", "bucket_start"], name="telemetry_keyuse_res_ts"),
            models.Index(fields=["key_id", "resolution", "bucket_start"], name="telemetry_keyuse_key_ts"),
            models.Index(fields=["team", "resolution", "bucket_start"], name="telemetry_keyuse_team_ts"),
        ]

    def __str__(self) -> str:
        return f"{self.resolution} key {self.key_id} at {self.bucket_start:%Y-%m-%d %H:%M:%S}"

    @property
    def errors(self) -> int:
        return self.errors_4xx + self.errors_5xx

    @property
    def error_rate(self) -> float | None:
        """(4xx + 5xx) / count."""
        return _ratio(self.errors, self.count)

    @property
    def ttft_mean_ms(self) -> float | None:
        return round(self.ttft_sum_ms / self.ttft_count, 3) if self.ttft_count else None
