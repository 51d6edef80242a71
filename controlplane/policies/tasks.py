"""Celery tasks of the policies app."""

from __future__ import annotations

import logging

import redis
from celery import shared_task

from controlplane.locks import task_lock
from controlplane.policies.publishing import PublishError, redis_client, redis_keys, republish_live

log = logging.getLogger(__name__)

RECONCILE_LIMITS_S = (20, 30)


@shared_task(
    name="policies.reconcile",
    soft_time_limit=RECONCILE_LIMITS_S[0],
    time_limit=RECONCILE_LIMITS_S[1],
    ignore_result=True,
)
def reconcile() -> int | None:
    """Make Redis hold the last published policy settings compiled with the current fleet.

    The fleet-change republish runs right after a change commits; when Redis was unreachable then
    (or lost its data since), this periodic pass publishes what the gateways are missing. It
    republishes what was last *published*, never the policy's database row: unpublished edits and
    publishes refused while Redis was down stay unpublished. Publishing is idempotent, so a pass
    that finds nothing to do writes nothing.
    Returns the live version number, or None when nothing was published yet or Redis is down.
    """
    try:
        with task_lock(redis_client(), redis_keys(), "policies-reconcile", RECONCILE_LIMITS_S[1]) as acquired:
            if not acquired:
                return None
            result = republish_live("reconcile: the fleet changed while the gateways could not be told")
            if result is None:
                return None
    except (PublishError, redis.RedisError) as exc:
        log.warning("reconcile: Redis unreachable, trying again next round: %s", exc)
        return None
    if result.created:
        log.info("reconcile published version %d", result.version.number)
    return result.version.number
