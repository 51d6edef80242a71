"""Tell open dashboards when a new policy version goes live, so the headline follows without a reload.

Telemetry's tasks push measurements to the dashboard group; this is the one push the control plane
makes, after the publishing transaction commits. It never fails a publish: the version is live
in Redis either way, and pages pick it up on their next load.
"""

from __future__ import annotations

import logging

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction
from django.db.models.signals import post_save
from django.dispatch import receiver

from controlplane.policies.models import PolicyVersion
from telemetry.groups import DASHBOARD_GROUP

log = logging.getLogger(__name__)

POLICY_PUBLISHED = "policy.published"


def policy_message(version: PolicyVersion) -> dict:
    """The ``policy.published`` message (documented in docs/dashboard.md)."""
    return {
        "type": POLICY_PUBLISHED,
        "id": version.policy_id,
        "name": version.policy.name,
        "algorithm": version.policy.algorithm,
        "version": version.number,
        "author": version.author_name,
        "note": version.note,
        "published_at": version.published_at.timestamp() if version.published_at else None,
    }


@receiver(post_save, sender=PolicyVersion)
def _version_saved(sender, instance: PolicyVersion, created: bool, raw: bool = False, **kwargs) -> None:
    if raw or not created or instance.published_at is None:
        return
    message = policy_message(instance)

    def push() -> None:
        layer = get_channel_layer()
        if layer is None:
            return
        try:
            async_to_sync(layer.group_send)(DASHBOARD_GROUP, message)
        except Exception as exc:  # a dashboard push must never fail a publish
            log.warning("dashboard push of policy v%s failed: %s", message["version"], exc)

    transaction.on_commit(push)
