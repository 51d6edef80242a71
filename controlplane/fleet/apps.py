from __future__ import annotations

from django.apps import AppConfig


class FleetConfig(AppConfig):
    name = "controlplane.fleet"
    label = "fleet"
    verbose_name = "Fleet"

    def ready(self) -> None:
        from controlplane.fleet import signals  # noqa: F401  (connects fleet-change republish)
