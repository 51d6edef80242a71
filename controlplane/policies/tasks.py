"""Celery tasks of the policies app."""

from __future__ import annotations

import logging
import time

import redis
from celery import shared_task
from celery.exceptions import SoftTimeLimitExceeded

from controlplane.connections import redis_client, redis_keys
from controlplane.locks import task_lock
from controlplane.policies import tuning
from controlplane.policies.models import RoutingPolicy
from controlplane.policies.publishing import PublishError, publish

log = logging.getLogger(__name__)

RECONCILE_LIMITS_S = (20, 30)
TUNE_LIMITS_S = (30, 45)  # a window's read is bounded (tuning.MAX_WINDOW_RECORDS)


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


@shared_task(
    name="policies.tune",
    soft_time_limit=TUNE_LIMITS_S[0],
    time_limit=TUNE_LIMITS_S[1],
    ignore_result=True,
)
def tune() -> str | None:
    """One tick of the online tuner (GORGO v2) on the active policy, when it has ``auto_tune`` on.

    Returns the closed window's outcome, or None when no window closed (too early, too few
    requests, tuning off, another run holds the lock, Redis unreachable).
    """
    try:
        with task_lock(redis_client(), redis_keys(), "policies-tune", TUNE_LIMITS_S[1]) as acquired:
            if not acquired:
                return None
            policy = RoutingPolicy.objects.filter(is_active=True, auto_tune=True, algorithm="gorgo").first()
            if policy is None:
                return None
            window = tuning.tune_policy(policy, time.time())
    except (PublishError, redis.RedisError) as exc:
        log.warning("tune: Redis unreachable, trying again next round: %s", exc)
        return None
    except SoftTimeLimitExceeded:
        log.warning("tune ran out of time; the window is decided next run")
        return None
    return window.outcome if window is not None else None
