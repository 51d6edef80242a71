"""Read-only serializers of the telemetry API."""

from __future__ import annotations

import time

import msgspec
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from controlplane.fleet.models import Node
from routing.contract import NodeLiveState, RTTEntry
from telemetry.aggregation import TOLERANCE_ABS_MS, TOLERANCE_REL, breakdown_of
from telemetry.choices import HealthChoices
from telemetry.models import HealthEvent, MetricSample, RequestAggregate, RTTSample


class RTTFromRegionSerializer(serializers.Serializer):
    """The live RTT from one region to a node (EWMA of the probes)."""

    region = serializers.CharField()
    node_id = serializers.IntegerField()
    rtt_ms = serializers.FloatField()
    jitter_ms = serializers.FloatField()
    samples = serializers.IntegerField()
    updated_at = serializers.FloatField(help_text="Unix seconds.")
    age_s = serializers.FloatField(help_text="Seconds since the last successful probe.")

    @staticmethod
    def of(entry: RTTEntry, now: float) -> dict:
        return {**msgspec.to_builtins(entry), "age_s": round(max(0.0, now - entry.updated_at), 3)}


class LiveNodeSerializer(serializers.ModelSerializer):
    """A node as the workers see it now: measured health, load, cache, RTT from every region.

    Live fields come from Redis (what the gateways read) and are null when not measured yet.
    """

    region = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    health = serializers.SerializerMethodField()
    health_changed_at = serializers.SerializerMethodField()
    health_reason = serializers.SerializerMethodField()
    scrape_failing = serializers.SerializerMethodField()
    scrape_error = serializers.SerializerMethodField()
    healthy = serializers.SerializerMethodField()
    num_running = serializers.SerializerMethodField()
    num_waiting = serializers.SerializerMethodField()
    kv_cache_usage = serializers.SerializerMethodField()
    prefix_hit_rate = serializers.SerializerMethodField()
    last_scrape_age_s = serializers.SerializerMethodField()
    last_probe_age_s = serializers.SerializerMethodField()
    rtt = serializers.SerializerMethodField()

    class Meta:
        model = Node
        fields = [
            "id",
            "name",
            "region",
            "state",
            "health",
            "health_changed_at",
            "health_reason",
            "scrape_failing",
            "scrape_error",
            "healthy",
            "num_running",
            "num_waiting",
            "kv_cache_usage",
            "prefix_hit_rate",
            "last_scrape_age_s",
            "last_probe_age_s",
            "rtt",
        ]
        read_only_fields = fields

    def _health(self, node: Node):
        try:
            return node.health
        except Node.health.RelatedObjectDoesNotExist:
            return None

    def _live(self, node: Node) -> NodeLiveState | None:
        return self.context.get("live", {}).get(node.pk)

    def _now(self) -> float:
        return self.context.get("now") or time.time()

    @extend_schema_field(serializers.ChoiceField(choices=HealthChoices.choices))
    def get_health(self, node: Node) -> str:
        row = self._health(node)
        return row.health if row is not None else HealthChoices.UNKNOWN

    @extend_schema_field(serializers.DateTimeField(allow_null=True))
    def get_health_changed_at(self, node: Node):
        row = self._health(node)
        return (
            serializers.DateTimeField().to_representation(row.changed_at) if row and row.changed_at else None
        )

    def get_health_reason(self, node: Node) -> str:
        row = self._health(node)
        return row.reason if row is not None else ""

    def get_scrape_failing(self, node: Node) -> bool:
        row = self._health(node)
        return bool(row and row.scrape_failing)

    def get_scrape_error(self, node: Node) -> str:
        row = self._health(node)
        return row.scrape_error if row is not None else ""

    @extend_schema_field(serializers.BooleanField(allow_null=True))
    def get_healthy(self, node: Node) -> bool | None:
        live = self._live(node)
        return live.healthy if live is not None else None

    @extend_schema_field(serializers.FloatField(allow_null=True))
    def get_num_running(self, node: Node) -> float | None:
        live = self._live(node)
        return live.num_running if live is not None else None

    @extend_schema_field(serializers.FloatField(allow_null=True))
    def get_num_waiting(self, node: Node) -> float | None:
        live = self._live(node)
        return live.num_waiting if live is not None else None

    @extend_schema_field(serializers.FloatField(allow_null=True, help_text="0..1"))
    def get_kv_cache_usage(self, node: Node) -> float | None:
        live = self._live(node)
        return live.kv_cache_usage if live is not None else None

    @extend_schema_field(
        serializers.FloatField(allow_null=True, help_text="0..1, tokens, last scrape interval")
    )
    def get_prefix_hit_rate(self, node: Node) -> float | None:
        live = self._live(node)
        return live.prefix_hit_rate if live is not None else None

    @extend_schema_field(serializers.FloatField(allow_null=True))
    def get_last_scrape_age_s(self, node: Node) -> float | None:
        live = self._live(node)
        if live is None or live.last_scrape_at is None:
            return None
        return round(max(0.0, self._now() - live.last_scrape_at), 3)

    @extend_schema_field(serializers.FloatField(allow_null=True))
    def get_last_probe_age_s(self, node: Node) -> float | None:
        live = self._live(node)
        if live is None or live.last_probe_at is None:
            return None
        return round(max(0.0, self._now() - live.last_probe_at), 3)

    @extend_schema_field(RTTFromRegionSerializer(many=True))
    def get_rtt(self, node: Node) -> list[dict]:
        entries = self.context.get("rtt", {}).get(node.pk, [])
        return [RTTFromRegionSerializer.of(entry, self._now()) for entry in entries]


class MatrixNodeSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    name = serializers.CharField()
    region = serializers.CharField()


class RTTMatrixSerializer(serializers.Serializer):
    """Every region (rows) x node (columns) round trip the probes measured."""

    updated_at = serializers.FloatField(allow_null=True, help_text="Unix seconds of the last table write.")
    regions = serializers.ListField(child=serializers.CharField())
    nodes = MatrixNodeSerializer(many=True)
    cells = RTTFromRegionSerializer(many=True)


class RTTSampleSerializer(serializers.ModelSerializer):
    region = serializers.CharField(
        source="region_label", read_only=True, allow_null=True, help_text="Region slug (kept when deleted)."
    )
    node_name = serializers.CharField(
        source="node_label", read_only=True, allow_null=True, help_text="Kept when the node is deleted."
    )

    class Meta:
        model = RTTSample
        fields = [
            "id",
            "ts",
            "region",
            "node",
            "node_name",
            "ok",
            "rtt_ms",
            "connect_ms",
            "status_code",
            "error",
        ]
        read_only_fields = fields


class MetricSampleSerializer(serializers.ModelSerializer):
    node_name = serializers.CharField(
        source="node_label", read_only=True, allow_null=True, help_text="Kept when the node is deleted."
    )

    class Meta:
        model = MetricSample
        fields = [
            "id",
            "ts",
            "node",
            "node_name",
            "ok",
            "error",
            "interval_s",
            "counters_reset",
            "num_running",
            "num_waiting",
            "kv_cache_usage",
            "prefix_queries_tokens",
            "prefix_hits_tokens",
            "prefix_hit_rate",
            "prompt_tokens_per_s",
            "generation_tokens_per_s",
            "preemptions",
            "requests_finished",
            "ttft_mean_ms",
            "ttft_p50_ms",
            "ttft_p90_ms",
            "ttft_p99_ms",
            "queue_mean_ms",
            "prefill_mean_ms",
            "decode_mean_ms",
            "e2e_mean_ms",
            "itl_mean_ms",
            "latency",
        ]
        read_only_fields = fields


class HealthEventSerializer(serializers.ModelSerializer):
    node_name = serializers.CharField(
        source="node_label", read_only=True, allow_null=True, help_text="Kept when the node is deleted."
    )

    class Meta:
        model = HealthEvent
        fields = ["id", "ts", "node", "node_name", "previous", "current", "source", "reason"]
        read_only_fields = fields


class BreakdownSerializer(serializers.Serializer):
    """Mean TTFT of the bucket and its parts: gateway + network + queue + prefill + other = TTFT."""

    ttft_mean_ms = serializers.FloatField()
    gateway_ms = serializers.FloatField()
    network_ms = serializers.FloatField()
    queue_ms = serializers.FloatField()
    prefill_ms = serializers.FloatField()
    other_ms = serializers.FloatField(help_text="The remainder (may be negative).")
    within_tolerance = serializers.BooleanField(
        help_text=f"|other_ms| <= max({TOLERANCE_ABS_MS:g} ms, {TOLERANCE_REL:.0%} of ttft_mean_ms)."
    )


class RequestAggregateSerializer(serializers.ModelSerializer):
    """One bucket of finished requests (per node or per gateway region)."""

    region = serializers.CharField(
        source="region_label", read_only=True, allow_null=True, help_text="Region slug (kept when deleted)."
    )
    node_name = serializers.CharField(
        source="node_label", read_only=True, allow_null=True, help_text="Kept when the node is deleted."
    )
    error_rate = serializers.SerializerMethodField()
    breakdown = serializers.SerializerMethodField()
    network_known = serializers.SerializerMethodField()
    node_stats_known = serializers.SerializerMethodField()
    cache_hit_rate = serializers.SerializerMethodField()

    class Meta:
        model = RequestAggregate
        fields = [
            "id",
            "resolution",
            "scope",
            "node",
            "node_name",
            "region",
            "bucket_start",
            "count",
            "errors",
            "error_rate",
            "ttft_count",
            "ttft_p50_ms",
            "ttft_p90_ms",
            "ttft_p99_ms",
            "breakdown",
            "network_known",
            "node_stats_known",
            "prompt_tokens",
            "cached_tokens",
            "predicted_cached_tokens",
            "cache_hit_rate",
        ]
        read_only_fields = fields

    @extend_schema_field(serializers.FloatField(allow_null=True))
    def get_error_rate(self, row: RequestAggregate) -> float | None:
        return round(row.errors / row.count, 4) if row.count else None

    @extend_schema_field(BreakdownSerializer(allow_null=True))
    def get_breakdown(self, row: RequestAggregate) -> dict | None:
        breakdown = breakdown_of(row)
        return msgspec.to_builtins(breakdown) if breakdown is not None else None

    @extend_schema_field(
        serializers.FloatField(allow_null=True, help_text="Share of TTFTs with a known RTT.")
    )
    def get_network_known(self, row: RequestAggregate) -> float | None:
        return round(row.network_count / row.ttft_count, 4) if row.ttft_count else None

    @extend_schema_field(
        serializers.FloatField(
            allow_null=True, help_text="Share of TTFTs with the node's queue/prefill figures."
        )
    )
    def get_node_stats_known(self, row: RequestAggregate) -> float | None:
        return round(row.node_stats_count / row.ttft_count, 4) if row.ttft_count else None

    @extend_schema_field(serializers.FloatField(allow_null=True, help_text="cached_tokens / prompt_tokens."))
    def get_cache_hit_rate(self, row: RequestAggregate) -> float | None:
        return round(row.cached_tokens / row.prompt_tokens, 4) if row.prompt_tokens else None
