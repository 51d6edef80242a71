"""What the policies refuse to let go: regions and models they name, the active or published policy.

Foreign keys already PROTECT most of these; the rules here also cover references that live in JSON
(residency rules) or many-to-many fields, where a delete would silently change what the live
policy means. Registered with core's ``delete_blockers`` (``controlplane/deletion.py``).
"""

from __future__ import annotations

from django.db import models

from controlplane.deletion import blocks_deletion, names
from controlplane.fleet.models import LLMModel, Region
from controlplane.policies.models import RoutingPolicy


@blocks_deletion
def policy_delete_blockers(obj: models.Model) -> list[str]:
    if isinstance(obj, Region):
        return _region_blockers(obj)
    if isinstance(obj, LLMModel):
        return _model_blockers(obj)
    if isinstance(obj, RoutingPolicy):
        return _policy_blockers(obj)
    return []


def _region_blockers(region: Region) -> list[str]:
    policies = [
        policy.name
        for policy in RoutingPolicy.objects.order_by("name")
        if any(
            isinstance(rule, dict)
            and (rule.get("client_region") == region.slug or region.slug in (rule.get("node_regions") or []))
            for rule in (policy.residency if isinstance(policy.residency, list) else [])
        )
    ]
    if policies:
        return [
            f"Region {region.slug} appears in the residency rules of {', '.join(policies)}; "
            "edit those policies first."
        ]
    return []


def _model_blockers(model: LLMModel) -> list[str]:
    policies = model.routing_policies.order_by("name")
    if policies.exists():
        return [
            f"Model {model.name} is in the model scope of {names(policies, 'name')}; "
            "removing it would widen those policies to every model. Edit them first."
        ]
    return []


def _policy_blockers(policy: RoutingPolicy) -> list[str]:
    if policy.is_active:
        return [f"Policy {policy.name} is the active policy; publish another policy first."]
    count = policy.versions.count()
    if count:
        return [
            f"Policy {policy.name} has {count} published version(s), kept as history for rollback; "
            "it cannot be deleted."
        ]
    return []
