"""Tell the apps above the fleet that it changed, after the change commits: ``fleet_changed``.

The policies app listens and republishes the active policy (``controlplane/policies/signals.py``);
the fleet itself knows nothing of policies. Receivers run once the transaction has committed, so a
receiver's failure (Redis down) can never fail the fleet change itself.
"""

from __future__ import annotations

from django.db import transaction
from django.db.models.signals import m2m_changed, post_delete, post_save
from django.dispatch import Signal, receiver

from controlplane.fleet.models import LLMModel, Node, Region

# Sent (sender: the changed model class) with ``reason``, e.g. "node us-east-1 changed", after
# the change's transaction commits.
fleet_changed = Signal()


def _announce_after_commit(sender: type, reason: str) -> None:
    transaction.on_commit(lambda: fleet_changed.send(sender=sender, reason=reason))


@receiver(post_save, sender=Node)
@receiver(post_save, sender=Region)
@receiver(post_save, sender=LLMModel)
def _fleet_saved(sender, instance, created, raw=False, **kwargs) -> None:
    if raw:
        return
    _announce_after_commit(
        sender, f"{sender.__name__.lower()} {instance} {'added' if created else 'changed'}"
    )


@receiver(post_delete, sender=Node)
@receiver(post_delete, sender=Region)
@receiver(post_delete, sender=LLMModel)
def _fleet_deleted(sender, instance, **kwargs) -> None:
    _announce_after_commit(sender, f"{sender.__name__.lower()} {instance} removed")


@receiver(m2m_changed, sender=Node.served_models.through)
def _node_models_changed(sender, instance, action, **kwargs) -> None:
    if action in {"post_add", "post_remove", "post_clear"}:
        _announce_after_commit(Node, f"models of {instance} changed")
