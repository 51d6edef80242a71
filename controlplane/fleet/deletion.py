"""What the fleet itself refuses to delete: an active node, a region that still has nodes, a model
still served. Each reason says what to do first."""

from __future__ import annotations

from django.db import models

from controlplane.deletion import blocks_deletion, names
from controlplane.fleet.choices import NodeStateChoices
from controlplane.fleet.models import LLMModel, Node, Region


@blocks_deletion
def fleet_delete_blockers(obj: models.Model) -> list[str]:
    # Draining and disabled nodes get no new requests: deleting one cannot surprise the traffic.
    if isinstance(obj, Node) and obj.state == NodeStateChoices.ACTIVE:
        return [
            f"Node {obj.name} is active: the gateways send it requests. Drain it first "
            f"(POST /api/v1/nodes/{obj.pk}/drain/ or the Nodes page), let its requests finish, "
            "then delete it."
        ]
    if isinstance(obj, Region):
        nodes = obj.nodes.order_by("name")
        if nodes.exists():
            return [
                f"Region {obj.slug} still has nodes ({names(nodes, 'name')}); drain and delete them "
                "(or move them to another region) first."
            ]
    if isinstance(obj, LLMModel):
        nodes = obj.nodes.order_by("name")
        if nodes.exists():
            return [
                f"Model {obj.name} is served by {names(nodes, 'name')}; remove it from those nodes first."
            ]
    return []
