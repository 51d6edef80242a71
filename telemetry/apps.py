from __future__ import annotations

from django.apps import AppConfig


class TelemetryConfig(AppConfig):
    """RTT probes, metrics scrapes, health, request aggregation (Celery tasks in ``tasks.py``)."""

    name = "telemetry"
    label = "telemetry"
    verbose_name = "Telemetry"

    def ready(self) -> None:
        # Node health, the RTT matrix and task lag on the control plane's /metrics.
        from telemetry import exporter  # noqa: F401
