"""Republish the live policy whenever the fleet changes (``fleet_changed``, sent after commit).

Changes within ``GORGO_REPUBLISH_DELAY_S`` are coalesced into one version (``policies.tasks``).
A failed republish (Redis down, policy no longer valid for the new fleet) never fails the fleet
change itself: it is logged, and the periodic reconcile task publishes once Redis is back.
"""

from __future__ import annotations

import logging

from django.dispatch import receiver

from controlplane.fleet.signals import fleet_changed
from controlplane.policies.tasks import schedule_fleet_republish

log = logging.getLogger(__name__)


@receiver(fleet_changed)
def republish_on_fleet_change(sender, reason: str, **kwargs) -> None:
    try:
        schedule_fleet_republish(reason)
    except Exception:
        log.exception("fleet change (%s) could not be published", reason)
