"""The telemetry app's pages outside the API: the control plane's Prometheus endpoint."""

from __future__ import annotations

from django.urls import path

from telemetry.exporter import metrics_view

urlpatterns = [
    path("metrics", metrics_view, name="metrics"),
]
