"""Republish the active policy whenever the fleet changes, after the change commits.

Changes within ``GORGO_REPUBLISH_DELAY_S`` are coalesced into one version (``policies.tasks``).
A failed republish (Redis down, policy no longer valid for the new fleet) never fails the fleet
change itself: it is logged, and the periodic reconcile task publishes once Redis is back.
"""

from __future__ import annotations

import logging

from django.db import transaction
from django.db.models.signals import m2m_changed, post_delete, post_save
from django.dispatch import receiver

from controlplane.fleet.models import LLMModel, Node, Region

log = logging.getLogger(__name__)


def _schedule_republish(reason: str) -> None:
    def run() -> None:
        from controlplane.policies.tasks import schedule_fleet_republish

        try:
            schedule_fleet_republish(reason)
        except Exception:
            log.exception("fleet change (%s) could not be published", reason)

    transaction.on_commit(run)


@receiver(post_save, sender=Node)
@receiver(post_save, sender=Region)
@receiver(post_save, sender=LLMModel)
def _fleet_saved(sender, instance, created, raw=False, **kwargs) -> None:
    if raw:
        return
    _schedule_republish(f"{sender.__name__.lower()} {instance} {'added' if created else 'changed'}")


@receiver(post_delete, sender=Node)
@receiver(post_delete, sender=Region)
@receiver(post_delete, sender=LLMModel)
def _fleet_deleted(sender, instance, **kwargs) -> None:
    _schedule_republish(f"{sender.__name__.lower()} {instance} removed")


@receiver(m2m_changed, sender=Node.served_models.through)
def _node_models_changed(sender, instance, action, **kwargs) -> None:
    if action in {"post_add", "post_remove", "post_clear"}:
        _schedule_republish(f"models of {instance} changed")
