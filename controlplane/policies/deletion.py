"""Why an object cannot be deleted without breaking routing.

One answer for the API (409 with the reasons) and the admin (listed as protected objects), so
both refuse the same deletes with the same words. Foreign keys already PROTECT most of these; the
rules here also cover references that live in JSON (residency rules) or many-to-many fields, where
a delete would silently change what the live policy means.
"""

from __future__ import annotations

from django.db import models

from controlplane.fleet.choices import NodeStateChoices
from controlplane.fleet.models import LLMModel, Node, Region
from controlplane.policies.models import RoutingPolicy


def delete_blockers(obj: models.Model) -> list[str]:
    """Human-readable reasons ``obj`` must not be deleted; empty when it may be."""
    if isinstance(obj, Node):
        return _node_blockers(obj)
    if isinstance(obj, Region):
        return _region_blockers(obj)
    if isinstance(obj, LLMModel):
        return _model_blockers(obj)
    if isinstance(obj, RoutingPolicy):
        return _policy_blockers(obj)
    return []


def _names(queryset: models.QuerySet, field: str) -> str:
    return ", ".join(queryset.values_list(field, flat=True)[:20])


def _node_blockers(node: Node) -> list[str]:
    # Draining and disabled nodes get no new requests: deleting one cannot surprise the traffic.
    if node.state == NodeStateChoices.ACTIVE:
        return [
            f"Node {node.name} is active: the gateways send it requests. Drain it first "
            f"(POST /api/v1/nodes/{node.pk}/drain/ or the Nodes page), let its requests finish, "
            "then delete it."
        ]
    return []


def _region_blockers(region: Region) -> list[str]:
    reasons = []
    nodes = region.nodes.order_by("name")
    if nodes.exists():
        reasons.append(
            f"Region {region.slug} still has nodes ({_names(nodes, 'name')}); drain and delete them "
            "(or move them to another region) first."
        )
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
        reasons.append(
            f"Region {region.slug} appears in the residency rules of {', '.join(policies)}; "
            "edit those policies first."
        )
    return reasons


def _model_blockers(model: LLMModel) -> list[str]:
    reasons = []
    nodes = model.nodes.order_by("name")
    if nodes.exists():
        reasons.append(
            f"Model {model.name} is served by {_names(nodes, 'name')}; remove it from those nodes first."
        )
    policies = model.routing_policies.order_by("name")
    if policies.exists():
        reasons.append(
            f"Model {model.name} is in the model scope of {_names(policies, 'name')}; "
            "removing it would widen those policies to every model. Edit them first."
        )
    return reasons


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
