"""Read-only telemetry API: live node state, RTT matrix, samples, aggregates, key usage, health events."""

from __future__ import annotations

import logging
import time

from drf_spectacular.utils import extend_schema
from rest_framework.exceptions import NotFound
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.api import BaseAPIView, BaseReadOnlyViewSet
from controlplane.connections import redis_client, redis_keys
from controlplane.fleet.models import Node, Region
from telemetry.api.serializers import (
    HealthEventSerializer,
    KeyUsageSerializer,
    LiveNodeSerializer,
    MetricSampleSerializer,
    RequestAggregateSerializer,
    RequestLogSerializer,
    RTTFromRegionSerializer,
    RTTMatrixSerializer,
    RTTSampleSerializer,
)
from telemetry.filtersets import (
    HealthEventFilterSet,
    KeyUsageFilterSet,
    MetricSampleFilterSet,
    RequestAggregateFilterSet,
    RequestLogFilterSet,
    RTTSampleFilterSet,
)
from telemetry.live import read_live_state
from telemetry.models import (
    HealthEvent,
    KeyUsageAggregate,
    MetricSample,
    ProcessedRequestEntry,
    RequestAggregate,
    RTTSample,
)

log = logging.getLogger(__name__)


class LiveNodeViewSet(BaseReadOnlyViewSet):
    """Every node with its measured health, load, KV-cache use, prefix hit rate and RTT per region."""

    queryset = Node.objects.select_related("region", "health").order_by("region__slug", "name")
    serializer_class = LiveNodeSerializer
    filterset_fields = ["state"]

    def get_serializer_context(self) -> dict:
        # Read Redis once per request, not once per node.
        context = super().get_serializer_context()
        state = read_live_state(redis_client(), redis_keys())
        rtt: dict[int, list] = {}
        for entry in state.rtt.entries if state.rtt is not None else ():
            rtt.setdefault(entry.node_id, []).append(entry)
        return {**context, "live": state.nodes, "rtt": rtt, "now": time.time()}


class RTTMatrixView(BaseAPIView):
    """The live RTT table as a region x node matrix (what the gateways route with)."""

    @extend_schema(responses=RTTMatrixSerializer)
    def get(self, request: Request) -> Response:
        table = read_live_state(redis_client(), redis_keys()).rtt
        regions = list(Region.objects.order_by("slug").values_list("slug", flat=True))
        nodes = list(Node.objects.select_related("region").order_by("region__slug", "name"))
        known_nodes, known_regions = {n.pk for n in nodes}, set(regions)
        now = time.time()
        cells = [
            RTTFromRegionSerializer.of(entry, now)
            for entry in (table.entries if table is not None else ())
            if entry.node_id in known_nodes and entry.region in known_regions
        ]
        data = {
            "updated_at": table.updated_at if table is not None else None,
            "regions": regions,
            "nodes": [{"id": n.pk, "name": n.name, "region": n.region.slug} for n in nodes],
            "cells": cells,
        }
        return Response(RTTMatrixSerializer(data).data)


class RTTSampleViewSet(BaseReadOnlyViewSet):
    """Individual RTT probes, newest first."""

    queryset = RTTSample.objects.select_related("region", "node")
    serializer_class = RTTSampleSerializer
    filterset_class = RTTSampleFilterSet


class MetricSampleViewSet(BaseReadOnlyViewSet):
    """Scrape intervals of every node, newest first."""

    queryset = MetricSample.objects.select_related("node")
    serializer_class = MetricSampleSerializer
    filterset_class = MetricSampleFilterSet


class HealthEventViewSet(BaseReadOnlyViewSet):
    """Health transitions, newest first."""

    queryset = HealthEvent.objects.select_related("node")
    serializer_class = HealthEventSerializer
    filterset_class = HealthEventFilterSet


class RequestAggregateViewSet(BaseReadOnlyViewSet):
    """Request buckets (10s or 1m) per node or gateway region, with the TTFT breakdown."""

    queryset = RequestAggregate.objects.select_related("region", "node")
    serializer_class = RequestAggregateSerializer
    filterset_class = RequestAggregateFilterSet


class KeyUsageViewSet(BaseReadOnlyViewSet):
    """Request buckets (10s or 1m) per client key and priority class: requests, errors, tokens, TTFT."""

    queryset = KeyUsageAggregate.objects.select_related("client_key")
    serializer_class = KeyUsageSerializer
    filterset_class = KeyUsageFilterSet


class RequestLogViewSet(BaseReadOnlyViewSet):
    """Finished requests as their gateways logged them, newest first: find one by its x-request-id
    (``/requests/{request_id}/`` or ``?request_id=``). Kept ``GORGO_RAW_RETENTION_H`` hours."""

    queryset = ProcessedRequestEntry.objects.exclude(record="").order_by("-ts", "-pk")
    serializer_class = RequestLogSerializer
    filterset_class = RequestLogFilterSet
    lookup_field = "request_id"
    lookup_value_regex = "[^/]+"

    def get_object(self) -> ProcessedRequestEntry:
        request_id = self.kwargs["request_id"]
        entry = ProcessedRequestEntry.find(request_id)
        if entry is None:
            raise NotFound(ProcessedRequestEntry.not_found_message(request_id))
        self.check_object_permissions(self.request, entry)
        return entry
