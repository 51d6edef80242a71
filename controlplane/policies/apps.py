from __future__ import annotations

from django.apps import AppConfig
from django.core import checks


class PoliciesConfig(AppConfig):
    name = "controlplane.policies"
    label = "policies"
    verbose_name = "Routing policies"

    def ready(self) -> None:
        from controlplane.policies.checks import check_algorithm_registry

        checks.register(check_algorithm_registry)
