"""Celery tasks of the policies app."""

from __future__ import annotations

import logging

import redis
from celery import shared_task

from controlplane.connections import redis_client, redis_keys
from controlplane.locks import task_lock
from controlplane.policies.models import RoutingPolicy
from controlplane.policies.publishing import PublishError, publish

log = logging.getLogger(__name__)

RECONCILE_LIMITS_S = (20, 30)


@shared_task(
    name="policies.reconcile",
    soft_time_limit=RECONCILE_LIMITS_S[0],
    time_limit=RECONCILE_LIMITS_S[1],
    ignore_result=True,
)
def reconcile() -> int | None:
    """Make Redis hold the active policy compiled with the current fleet.

    The fleet-change republish runs right after a change commits; when Redis was unreachable then
    (or lost its data since), this periodic pass publishes what the gateways are missing.
    Publishing is idempotent, so a pass that finds nothing to do writes nothing.
    Returns the live version number, or None when there is no active policy or Redis is down.
    """
    try:
        with task_lock(redis_client(), redis_keys(), "policies-reconcile", RECONCILE_LIMITS_S[1]) as acquired:
            if not acquired:
                return None
            policy = RoutingPolicy.objects.filter(is_active=True).first()
            if policy is None:
                return None
            result = publish(policy, note="reconcile: fleet changed while Redis was unreachable")
    except (PublishError, redis.RedisError) as exc:
        log.warning("reconcile: Redis unreachable, trying again next round: %s", exc)
        return None
    if result.created:
        log.info("reconcile published version %d", result.version.number)
    return result.version.number
