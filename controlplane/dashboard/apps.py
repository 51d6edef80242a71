from __future__ import annotations

from django.apps import AppConfig


class DashboardConfig(AppConfig):
    """Dashboard pages, the policy editor and the ``/ws/dashboard/`` live-update socket."""

    name = "controlplane.dashboard"
    label = "dashboard"
    verbose_name = "Dashboard"

    def ready(self) -> None:
        from controlplane.dashboard import signals  # noqa: F401  (pushes new policy versions live)
