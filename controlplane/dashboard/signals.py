"""Tell open dashboards when a new policy version goes live, so the headline follows without a reload,
and when a shadow's or canary's figures change (issue 23), so the policy page shows them live.

Telemetry's tasks push measurements to the dashboard group; these are the pushes the control plane
makes, after the transaction commits. They never fail a publish or a worker's tick: the state is
in the database and Redis either way, and pages pick it up on their next load.
"""

from __future__ import annotations

import logging

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction
from django.db.models.signals import post_save
from django.dispatch import receiver

from controlplane.policies import experiments
from controlplane.policies.choices import ExperimentKindChoices
from controlplane.policies.experiment_figures import figures_without_histograms
from controlplane.policies.models import PolicyExperiment, PolicyVersion
from telemetry.groups import DASHBOARD_GROUP

log = logging.getLogger(__name__)

POLICY_PUBLISHED = "policy.published"
POLICY_EXPERIMENT = "policy.experiment"


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
    _push_after_commit(policy_message(instance))


def experiment_message(experiment: PolicyExperiment) -> dict:
    """The ``policy.experiment`` message (documented in docs/dashboard.md)."""
    comparison = (
        [verdict.as_json() for verdict in experiments.verdicts(experiment)]
        if experiment.kind == ExperimentKindChoices.CANARY
        else []
    )
    return {
        "type": POLICY_EXPERIMENT,
        "id": experiment.pk,
        "kind": experiment.kind,
        "status": experiment.status,
        "policy": experiment.policy_id,
        "share_percent": experiment.share_percent,
        "end_note": experiment.end_note,
        "regions": figures_without_histograms(experiment.figures),
        "comparison": comparison,
    }


@receiver(post_save, sender=PolicyExperiment)
def _experiment_saved(sender, instance: PolicyExperiment, raw: bool = False, **kwargs) -> None:
    if not raw:
        _push_after_commit(experiment_message(instance))


def _push_after_commit(message: dict) -> None:
    def push() -> None:
        layer = get_channel_layer()
        if layer is None:
            return
        try:
            async_to_sync(layer.group_send)(DASHBOARD_GROUP, message)
        except Exception as exc:  # a dashboard push must never fail a publish or a tick
            log.warning("dashboard push %s failed: %s", message["type"], exc)

    transaction.on_commit(push)
