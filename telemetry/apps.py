from __future__ import annotations

from django.apps import AppConfig


class TelemetryConfig(AppConfig):
    """RTT probes, metrics scrapes, health, request aggregation (Celery tasks in ``tasks.py``)."""

    name = "telemetry"
    label = "telemetry"
    verbose_name = "Telemetry"

    def ready(self) -> None:
        from telemetry import signals  # noqa: F401  (connects the receivers)
