"""Keep the history of a node or region that is being deleted, under its name.

The telemetry foreign keys are ``SET_NULL``; just before the delete, the name goes onto every row
that still points at the object, so the rows say whose they were.
"""

from __future__ import annotations

from django.db.models.signals import pre_delete
from django.dispatch import receiver

from controlplane.fleet.models import Node, Region
from telemetry.models import HealthEvent, MetricSample, RequestAggregate, RTTSample


@receiver(pre_delete, sender=Node)
def _keep_node_history(sender, instance: Node, **kwargs) -> None:
    for model in (HealthEvent, RTTSample, MetricSample, RequestAggregate):
        model.objects.filter(node=instance).update(node_name=instance.name)


@receiver(pre_delete, sender=Region)
def _keep_region_history(sender, instance: Region, **kwargs) -> None:
    for model in (RTTSample, RequestAggregate):
        model.objects.filter(region=instance).update(region_slug=instance.slug)
