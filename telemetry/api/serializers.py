"""Read-only serializers of the telemetry API."""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from controlplane.fleet.choices import NodeStateChoices
from controlplane.fleet.models import Node
from routing.contract import NodeLiveState, RTTEntry
from telemetry.aggregation import TOLERANCE_ABS_MS, TOLERANCE_REL, breakdown_of, prediction_quality_of
from telemetry.choices import HealthChoices
from telemetry.models import (
    HealthEvent,
    KeyUsageAggregate,
    MetricSample,
    NodeHealth,
    ProcessedRequestEntry,
    RequestAggregate,
    RTTSample,
)


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


@dataclass(frozen=True, slots=True)
class LiveNode:
    """A node with what the workers measured: its health row and its live document (None: not yet)."""

    node: Node
    health: NodeHealth
    live: NodeLiveState | None
    rtt: list[dict]
    last_scrape_age_s: float | None
    last_probe_age_s: float | None

    @classmethod
    def of(cls, node: Node, context: dict) -> LiveNode:
        now = context.get("now") or time.time()
        live = context.get("live", {}).get(node.pk)
        try:
            health = node.health
        except Node.health.RelatedObjectDoesNotExist:
            health = NodeHealth(node=node)  # never judged: unknown, no reason
        return cls(
            node=node,
            health=health,
            live=live,
            rtt=[RTTFromRegionSerializer.of(entry, now) for entry in context.get("rtt", {}).get(node.pk, [])],
            last_scrape_age_s=_age_s(now, live.last_scrape_at if live is not None else None),
            last_probe_age_s=_age_s(now, live.last_probe_at if live is not None else None),
        )


def _age_s(now: float, at: float | None) -> float | None:
    return round(max(0.0, now - at), 3) if at is not None else None


class LiveNodeSerializer(serializers.Serializer):
    """A node as the workers see it now: measured health, load, cache, RTT from every region.

    Live fields come from Redis (what the gateways read) and are null when not measured yet.
    """

    id = serializers.IntegerField(source="node.pk", read_only=True)
    name = serializers.CharField(source="node.name", read_only=True)
    region = serializers.CharField(source="node.region.slug", read_only=True)
    state = serializers.ChoiceField(source="node.state", choices=NodeStateChoices.choices, read_only=True)
    health = serializers.ChoiceField(source="health.health", choices=HealthChoices.choices, read_only=True)
    health_changed_at = serializers.DateTimeField(source="health.changed_at", read_only=True, allow_null=True)
    health_reason = serializers.CharField(source="health.reason", read_only=True)
    scrape_failing = serializers.BooleanField(source="health.scrape_failing", read_only=True)
    scrape_error = serializers.CharField(source="health.scrape_error", read_only=True)
    healthy = serializers.BooleanField(source="live.healthy", read_only=True, allow_null=True)
    num_running = serializers.FloatField(source="live.num_running", read_only=True, allow_null=True)
    num_waiting = serializers.FloatField(source="live.num_waiting", read_only=True, allow_null=True)
    kv_cache_usage = serializers.FloatField(
        source="live.kv_cache_usage", read_only=True, allow_null=True, help_text="0..1"
    )
    prefix_hit_rate = serializers.FloatField(
        source="live.prefix_hit_rate",
        read_only=True,
        allow_null=True,
        help_text="0..1, tokens, last scrape interval",
    )
    last_scrape_age_s = serializers.FloatField(read_only=True, allow_null=True)
    last_probe_age_s = serializers.FloatField(read_only=True, allow_null=True)
    rtt = RTTFromRegionSerializer(many=True, read_only=True)

    def to_representation(self, node: Node) -> dict:
        return super().to_representation(LiveNode.of(node, self.context))


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


class PredictionQualitySerializer(serializers.Serializer):
    """The cost model's predicted TTFT (gateway + rtt + queue + prefill terms of the decision)
    against the measured TTFT; error = measured - predicted, in ms."""

    count = serializers.IntegerField(help_text="Requests with both a measured and a predicted TTFT.")
    bias_ms = serializers.FloatField(help_text="Mean error: above 0 the model predicts too little.")
    mean_abs_error_ms = serializers.FloatField()
    median_abs_error_ms = serializers.FloatField(allow_null=True)
    p90_abs_error_ms = serializers.FloatField(allow_null=True)
    error_p10_ms = serializers.FloatField(allow_null=True)
    error_p50_ms = serializers.FloatField(allow_null=True)
    error_p90_ms = serializers.FloatField(allow_null=True)


class RequestAggregateSerializer(serializers.ModelSerializer):
    """One bucket of finished requests (per node or per gateway region)."""

    region = serializers.CharField(
        source="region_label", read_only=True, allow_null=True, help_text="Region slug (kept when deleted)."
    )
    node_name = serializers.CharField(
        source="node_label", read_only=True, allow_null=True, help_text="Kept when the node is deleted."
    )
    error_rate = serializers.FloatField(
        read_only=True, allow_null=True, help_text="Server-side failures (5xx, no answer) per request."
    )
    client_error_rate = serializers.FloatField(read_only=True, allow_null=True, help_text="4xx per request.")
    breakdown = serializers.SerializerMethodField()
    network_known = serializers.FloatField(
        read_only=True, allow_null=True, help_text="Share of TTFTs with a known RTT."
    )
    node_stats_known = serializers.FloatField(
        read_only=True, allow_null=True, help_text="Share of TTFTs with the node's queue/prefill figures."
    )
    cache_hit_rate = serializers.FloatField(
        read_only=True,
        allow_null=True,
        help_text="cached_tokens / prompt tokens of the requests that reported cached_tokens "
        "(null: none did; vLLM reports them only with --enable-prompt-tokens-details).",
    )
    prediction = serializers.SerializerMethodField()

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
            "client_errors",
            "client_error_rate",
            "ttft_count",
            "ttft_p50_ms",
            "ttft_p90_ms",
            "ttft_p99_ms",
            "breakdown",
            "network_known",
            "node_stats_known",
            "prompt_tokens",
            "cached_tokens",
            "cached_reported_prompt_tokens",
            "predicted_cached_tokens",
            "cache_hit_rate",
            "prediction",
        ]
        read_only_fields = fields

    @extend_schema_field(BreakdownSerializer(allow_null=True))
    def get_breakdown(self, row: RequestAggregate) -> dict | None:
        breakdown = breakdown_of(row)
        return msgspec.to_builtins(breakdown) if breakdown is not None else None

    @extend_schema_field(PredictionQualitySerializer(allow_null=True))
    def get_prediction(self, row: RequestAggregate) -> dict | None:
        quality = prediction_quality_of(row)
        return msgspec.to_builtins(quality) if quality is not None else None


class KeyUsageSerializer(serializers.ModelSerializer):
    """One bucket of one client key's requests (the key's public id, never its secret)."""

    key_name = serializers.CharField(
        source="client_key.name", read_only=True, allow_null=True, help_text="Null once the key is deleted."
    )
    errors = serializers.IntegerField(read_only=True, help_text="errors_4xx + errors_5xx.")
    error_rate = serializers.FloatField(read_only=True, allow_null=True, help_text="errors / count.")
    ttft_mean_ms = serializers.FloatField(read_only=True, allow_null=True)

    class Meta:
        model = KeyUsageAggregate
        fields = [
            "id",
            "resolution",
            "bucket_start",
            "key_id",
            "key_name",
            "team",
            "priority",
            "count",
            "errors",
            "errors_4xx",
            "errors_5xx",
            "error_rate",
            "limited",
            "refused",
            "prompt_tokens",
            "completion_tokens",
            "cached_tokens",
            "usage_count",
            "ttft_count",
            "ttft_mean_ms",
            "ttft_p50_ms",
            "ttft_p99_ms",
        ]
        read_only_fields = fields


class RequestLogSerializer(serializers.ModelSerializer):
    """One finished request as its gateway logged it (``RequestRecord``), found by x-request-id."""

    record = serializers.SerializerMethodField(
        help_text="The gateway's RequestRecord: node, status, tokens, TTFT, cost terms, key id, error."
    )

    class Meta:
        model = ProcessedRequestEntry
        fields = ["request_id", "ts", "stream_id", "record"]

    @extend_schema_field(OpenApiTypes.OBJECT)
    def get_record(self, entry: ProcessedRequestEntry) -> dict:
        return entry.decoded()
