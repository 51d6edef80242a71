"""Celery tasks of the policies app."""

from __future__ import annotations

import logging
import time

import kombu.exceptions
import redis
from celery import shared_task
from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.core.exceptions import ValidationError

from controlplane.connections import redis_client, redis_keys
from controlplane.locks import task_lock
from controlplane.policies import experiment_figures, experiments, tuning, whatif
from controlplane.policies.choices import ExperimentStatusChoices
from controlplane.policies.models import PolicyExperiment, RoutingPolicy
from controlplane.policies.publishing import PublishError, republish_active, republish_live
from controlplane.reconcile import restore_all
from simulator.replay import ReplayTooSlow

log = logging.getLogger(__name__)

RECONCILE_LIMITS_S = (20, 30)
TUNE_LIMITS_S = (30, 45)  # a tick reads at most experiment_figures.MAX_RECORDS_PER_TICK records
WATCH_LIMITS_S = (30, 45)  # a tick's read is bounded (experiment_figures.MAX_RECORDS_PER_TICK)


@shared_task(
    name="policies.reconcile",
    soft_time_limit=RECONCILE_LIMITS_S[0],
    time_limit=RECONCILE_LIMITS_S[1],
    ignore_result=True,
)
def reconcile() -> dict[str, str | None]:
    """Restore in Redis everything the gateways read that Redis lost or missed
    (``controlplane.reconcile``: the policy snapshot, the client key set).

    Returns what each restorer did (empty when another pass holds the lock or Redis is away).
    """
    try:
        with task_lock(redis_client(), redis_keys(), "policies-reconcile", RECONCILE_LIMITS_S[1]) as acquired:
            return restore_all() if acquired else {}
    except redis.RedisError as exc:
        log.warning("reconcile: Redis unreachable, trying again next round: %s", exc)
        return {}


def restore_policy() -> str | None:
    """Make Redis hold the last published policy settings compiled with the current fleet.

    The fleet-change republish runs right after a change commits; when Redis was unreachable then
    (or lost its data since), this periodic pass publishes what the gateways are missing. It
    republishes what was last *published*, never the policy's database row: unpublished edits and
    publishes refused while Redis was down stay unpublished. Publishing is idempotent, so a pass
    that finds nothing to do writes nothing (but writes the live snapshot back when Redis lost it).
    Returns what it published, or None when nothing was needed, published yet, or Redis is down.
    """
    try:
        result = republish_live("reconcile: the fleet changed while the gateways could not be told")
    except (PublishError, redis.RedisError) as exc:
        log.warning("reconcile: Redis unreachable, trying again next round: %s", exc)
        return None
    if result is None or not (result.created or result.restored):
        return None
    return f"{'published' if result.created else 'wrote back'} version {result.version.number}"


REPUBLISH_LIMITS_S = (20, 30)
# The "a republish is scheduled" marker outlives the countdown by this much, so a worker that is
# down (and never clears it) delays the next burst's schedule by at most this long.
_SCHEDULED_GRACE_S = 30.0
_NOTE_LIMIT = 500
_NOTE_PREFIX = "fleet change: "
_SCHEDULED = "fleet-republish-scheduled"
# Descriptions kept for the next note; a note shows a few and counts the rest.
_PENDING_LIMIT = 1000


def schedule_fleet_republish(reason: str) -> None:
    """Republish after a fleet change committed: at once, or coalesced with the burst it is part of.

    With ``GORGO_REPUBLISH_DELAY_S`` > 0 the reason joins a Redis list and the first change of a
    burst enqueues ``republish_fleet_changes`` that many seconds later; every change until then is
    published by that one run, as one version. Never raises for Redis: reconcile catches up.
    """
    delay_s = settings.GORGO_REPUBLISH_DELAY_S
    if delay_s <= 0:
        try:
            republish_active(reason)
        except PublishError as exc:
            log.warning("fleet change (%s) not yet published: %s", reason, exc)
        return
    client, keys = redis_client(), redis_keys()
    try:
        pipe = client.pipeline(transaction=True)
        pipe.rpush(keys.fleet_changes, reason[:200])
        pipe.ltrim(keys.fleet_changes, -_PENDING_LIMIT, -1)  # bounded even with no worker running
        pipe.execute()
        scheduled = client.set(
            keys.lock(_SCHEDULED), "1", nx=True, px=int((delay_s + _SCHEDULED_GRACE_S) * 1000)
        )
        if scheduled:
            republish_fleet_changes.apply_async(countdown=delay_s, expires=delay_s + _SCHEDULED_GRACE_S)
    except (redis.RedisError, kombu.exceptions.OperationalError) as exc:
        log.warning("fleet change (%s) not yet published, reconcile will: %s", reason, exc)


def describe_changes(reasons: list[str]) -> str:
    """``fleet change: node a changed; node b added (+3 more)``, within a version note's length."""
    unique = list(dict.fromkeys(reasons))
    shown: list[str] = []
    for index, reason in enumerate(unique):
        more = len(unique) - index - 1
        if len(_NOTE_PREFIX + "; ".join([*shown, reason]) + f" (+{more} more)") > _NOTE_LIMIT:
            break
        shown.append(reason)
    hidden = len(unique) - len(shown)
    return _NOTE_PREFIX + "; ".join(shown) + (f" (+{hidden} more)" if hidden else "")


@shared_task(
    name="policies.republish_fleet_changes",
    soft_time_limit=REPUBLISH_LIMITS_S[0],
    time_limit=REPUBLISH_LIMITS_S[1],
    ignore_result=True,
)
def republish_fleet_changes() -> int | None:
    """Publish every fleet change collected since the last run as one version that lists them.

    Returns the new version number, or None when nothing was new (or Redis is down: reconcile
    publishes it later).
    """
    client, keys = redis_client(), redis_keys()
    try:
        with task_lock(client, keys, "fleet-republish", REPUBLISH_LIMITS_S[1]) as acquired:
            if not acquired:
                # Another run is publishing; run again after it, for what it may not have seen.
                republish_fleet_changes.apply_async(countdown=settings.GORGO_REPUBLISH_DELAY_S)
                return None
            # Changes from now on schedule a run of their own; the ones so far are this run's.
            client.delete(keys.lock(_SCHEDULED))
            pipe = client.pipeline(transaction=True)
            pipe.lrange(keys.fleet_changes, 0, -1)
            pipe.delete(keys.fleet_changes)
            raw, _ = pipe.execute()
            reasons = [item.decode() for item in raw]
            if not reasons:
                return None
            result = republish_live(describe_changes(reasons))
    except (PublishError, redis.RedisError) as exc:
        log.warning("fleet changes not yet published, reconcile will: %s", exc)
        return None
    if result is None or not result.created:
        return None
    log.info("published %d fleet change(s) as version %d", len(reasons), result.version.number)
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


WHAT_IF_LIMITS_S = (100, 120)  # two replays of at most whatif.REPLAY_WALL_BUDGET_S each


@shared_task(
    name="policies.what_if",
    soft_time_limit=WHAT_IF_LIMITS_S[0],
    time_limit=WHAT_IF_LIMITS_S[1],
    ignore_result=True,
)
def what_if(run_id: str, policy_id: int, minutes: int, now_s: float) -> str:
    """Replay the last ``minutes`` of traffic with a policy's draft and with the live policy.

    The answer (or why there is none) is stored under the run's id (``whatif.save_run``) for the
    API and the policy page to fetch. One run at a time per fleet: a replay takes a core for up to a
    minute, and a second one queued behind the lock waits its turn instead of sharing the core.
    Returns the run's final status.
    """
    base: dict[str, object] = {"id": run_id, "policy": policy_id, "minutes": minutes}
    try:
        with task_lock(redis_client(), redis_keys(), "policies-what-if", WHAT_IF_LIMITS_S[1]) as acquired:
            if not acquired:
                what_if.apply_async((run_id, policy_id, minutes, now_s), countdown=5)
                return "pending"
            policy = RoutingPolicy.objects.filter(pk=policy_id).first()
            if policy is None:
                whatif.save_run(run_id, {**base, "status": "failed", "error": "The policy was deleted."})
                return "failed"
            result = whatif.run_what_if(policy, minutes, now_s)
    except (whatif.NoTraffic, whatif.NothingLive) as exc:
        whatif.save_run(run_id, {**base, "status": "failed", "error": str(exc.detail)})
        return "failed"
    except ValidationError as exc:
        whatif.save_run(run_id, {**base, "status": "failed", "error": "; ".join(exc.messages)})
        return "failed"
    except (ReplayTooSlow, SoftTimeLimitExceeded):
        error = "The replay ran out of time; choose a shorter window."
        whatif.save_run(run_id, {**base, "status": "failed", "error": error})
        return "failed"
    except redis.RedisError as exc:
        log.warning("what-if %s: Redis unreachable: %s", run_id, exc)
        return "failed"
    whatif.save_run(run_id, {**base, "status": "done", "result": result.to_json()})
    return "done"


@shared_task(
    name="policies.watch_experiments",
    soft_time_limit=WATCH_LIMITS_S[0],
    time_limit=WATCH_LIMITS_S[1],
    ignore_result=True,
)
def watch_experiments() -> dict[int, int] | None:
    """Sum the request log into the running shadows' and canaries' figures; roll a worse canary back.

    Returns, per running experiment id, how many of its records this tick counted; None when
    another run holds the lock or Redis is unreachable (the next tick goes on from the cursor).
    """
    client, keys = redis_client(), redis_keys()
    counted: dict[int, int] = {}
    try:
        with task_lock(client, keys, "policies-experiments", WATCH_LIMITS_S[1]) as acquired:
            if not acquired:
                return None
            running = PolicyExperiment.objects.filter(status=ExperimentStatusChoices.RUNNING).select_related(
                "policy", "source_version"
            )
            for experiment in running:
                counted[experiment.pk] = experiment_figures.collect(client, keys, experiment)
                experiments.check_canary(experiment)
    except (PublishError, redis.RedisError) as exc:
        log.warning("watch_experiments: Redis unreachable, trying again next round: %s", exc)
        return None
    except SoftTimeLimitExceeded:
        log.warning("watch_experiments ran out of time; the rest is counted next run")
        return None
    return counted
