from __future__ import annotations

from django.apps import AppConfig
from django.core import checks


class PoliciesConfig(AppConfig):
    name = "controlplane.policies"
    label = "policies"
    verbose_name = "Routing policies"

    def ready(self) -> None:
        # The republish on fleet changes, and the policies' delete rules (a region in residency
        # rules, a model in a scope): the fleet and core ask through their own registries.
        from controlplane import reconcile
        from controlplane.policies import deletion, metrics, signals  # noqa: F401
        from controlplane.policies.checks import check_algorithm_registry
        from controlplane.policies.tasks import restore_policy

        reconcile.register("policy", restore_policy)

        checks.register(check_algorithm_registry)
