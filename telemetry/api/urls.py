"""Routes of the telemetry API, mounted at /api/v1/telemetry/."""

from __future__ import annotations

from django.urls import path
from rest_framework.routers import SimpleRouter

from telemetry.api import views

router = SimpleRouter()
router.register("live-nodes", views.LiveNodeViewSet, basename="telemetry-live-node")
router.register("rtt-samples", views.RTTSampleViewSet, basename="telemetry-rtt-sample")
router.register("metric-samples", views.MetricSampleViewSet, basename="telemetry-metric-sample")
router.register("health-events", views.HealthEventViewSet, basename="telemetry-health-event")
router.register("request-aggregates", views.RequestAggregateViewSet, basename="telemetry-request-aggregate")
router.register("key-usage", views.KeyUsageViewSet, basename="telemetry-key-usage")
router.register("requests", views.RequestLogViewSet, basename="telemetry-request")

urlpatterns = [
    path("rtt-matrix/", views.RTTMatrixView.as_view(), name="telemetry-rtt-matrix"),
    *router.urls,
]
