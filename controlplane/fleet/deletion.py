"""What the fleet itself refuses to delete: a region that still has nodes, a model still served."""

from __future__ import annotations

from django.db import models

from controlplane.deletion import blocks_deletion, names
from controlplane.fleet.models import LLMModel, Region


@blocks_deletion
def fleet_delete_blockers(obj: models.Model) -> list[str]:
    if isinstance(obj, Region):
        nodes = obj.nodes.order_by("name")
        if nodes.exists():
            return [f"Region {obj.slug} still has nodes ({names(nodes, 'name')}); move or delete them first."]
    if isinstance(obj, LLMModel):
        nodes = obj.nodes.order_by("name")
        if nodes.exists():
            return [
                f"Model {obj.name} is served by {names(nodes, 'name')}; remove it from those nodes first."
            ]
    return []
