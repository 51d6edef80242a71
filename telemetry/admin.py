"""Admin views of telemetry history: read-only, written by the workers."""

from __future__ import annotations

from django.contrib import admin

from telemetry.models import (
    HealthEvent,
    KeyUsageAggregate,
    MetricSample,
    NodeHealth,
    RequestAggregate,
    RTTSample,
)


class ReadOnlyAdmin(admin.ModelAdmin):
    """Workers write these rows; people only look at them."""

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False


@admin.register(NodeHealth)
class NodeHealthAdmin(ReadOnlyAdmin):
    list_display = ["node", "health", "changed_at", "scrape_failing", "reason"]
    list_filter = ["health", "scrape_failing"]
    list_select_related = ["node"]


@admin.register(HealthEvent)
class HealthEventAdmin(ReadOnlyAdmin):
    list_display = ["ts", "node", "previous", "current", "source", "reason"]
    list_filter = ["current", "source"]
    list_select_related = ["node"]
    date_hierarchy = "ts"


@admin.register(RTTSample)
class RTTSampleAdmin(ReadOnlyAdmin):
    list_display = ["ts", "region", "node", "ok", "rtt_ms", "connect_ms", "error"]
    list_filter = ["ok", "region"]
    list_select_related = ["region", "node"]
    date_hierarchy = "ts"


@admin.register(MetricSample)
class MetricSampleAdmin(ReadOnlyAdmin):
    list_display = [
        "ts",
        "node",
        "ok",
        "num_running",
        "num_waiting",
        "kv_cache_usage",
        "prefix_hit_rate",
        "error",
    ]
    list_filter = ["ok"]
    list_select_related = ["node"]
    date_hierarchy = "ts"


@admin.register(RequestAggregate)
class RequestAggregateAdmin(ReadOnlyAdmin):
    list_display = ["bucket_start", "resolution", "scope", "node", "region", "count", "errors", "ttft_p50_ms"]
    list_filter = ["resolution", "scope"]
    list_select_related = ["node", "region"]
    date_hierarchy = "bucket_start"


@admin.register(KeyUsageAggregate)
class KeyUsageAggregateAdmin(ReadOnlyAdmin):
    list_display = [
        "bucket_start",
        "resolution",
        "key_id",
        "team",
        "priority",
        "count",
        "errors_4xx",
        "errors_5xx",
        "limited",
        "ttft_p50_ms",
    ]
    list_filter = ["resolution", "priority", "team"]
    search_fields = ["key_id", "team"]
    date_hierarchy = "bucket_start"
