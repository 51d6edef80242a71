from __future__ import annotations

from django.apps import AppConfig


class PoliciesConfig(AppConfig):
    name = "controlplane.policies"
    label = "policies"
    verbose_name = "Routing policies"
