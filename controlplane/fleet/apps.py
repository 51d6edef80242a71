from __future__ import annotations

from django.apps import AppConfig


class FleetConfig(AppConfig):
    name = "controlplane.fleet"
    label = "fleet"
    verbose_name = "Fleet"

    def ready(self) -> None:
        # Connects the model signals that announce fleet changes, and the fleet's delete rules.
        from controlplane.fleet import deletion, signals  # noqa: F401
