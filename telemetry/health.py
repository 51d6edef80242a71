"""Node health: hysteresis over check outcomes, compare-and-swap transitions, events, live state.

Rules (thresholds from settings, defaults 3/2):

- each check kind (``probe``: GET /health from every region; ``scrape``: GET /metrics) keeps a
  streak of consecutive outcomes per node in Redis, shared by every worker;
- a node becomes **unhealthy** as soon as one kind has ``GORGO_HEALTH_FAILURES`` consecutive
  failures, and **healthy** when every kind seen so far has ``GORGO_HEALTH_SUCCESSES``
  consecutive successes; in between nothing changes (hysteresis);
- probes from all regions feed one streak: a dead node fails everywhere and crosses the threshold
  within one round of three regions, while a node that only one region cannot reach stays
  routable for the others (that region's RTT entry simply stops updating).

A transition is ``NodeHealth.objects.filter(pk=..., health=old).update(health=new)``: the worker
whose update changed the row records the event; a worker that lost the race does nothing. This
module only decides: the round that fed it the outcomes (``telemetry.rounds.settle``) folds the
transitions into the one live-state write it announces to the gateways, then tells the dashboard.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import redis
from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from controlplane.fleet.models import Node
from routing.contract import RedisKeys
from telemetry.choices import CheckChoices, HealthChoices
from telemetry.groups import HealthUpdate
from telemetry.live import STATE_TTL_S, push_dashboard, telemetry_keys
from telemetry.models import HealthEvent, NodeHealth

log = logging.getLogger(__name__)

# KEYS[1] streak hash; ARGV: check kind, '1' ok / '0' failed, ttl. Returns the whole hash.
_RECORD_OUTCOME = """
local ok_field, fail_field = ARGV[1] .. ':ok', ARGV[1] .. ':fail'
if ARGV[2] == '1' then
  redis.call('HINCRBY', KEYS[1], ok_field, 1)
  redis.call('HSET', KEYS[1], fail_field, 0)
else
  redis.call('HINCRBY', KEYS[1], fail_field, 1)
  redis.call('HSET', KEYS[1], ok_field, 0)
end
redis.call('EXPIRE', KEYS[1], ARGV[3])
return redis.call('HGETALL', KEYS[1])
"""


@dataclass(frozen=True, slots=True)
class Outcome:
    """The result of one check of one node."""

    node_id: int
    ok: bool
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Streak:
    """Consecutive successes and failures of one check kind (one of them is always 0)."""

    successes: int = 0
    failures: int = 0


@dataclass(frozen=True, slots=True)
class Thresholds:
    failures: int
    successes: int

    @classmethod
    def from_settings(cls) -> Thresholds:
        return cls(failures=settings.GORGO_HEALTH_FAILURES, successes=settings.GORGO_HEALTH_SUCCESSES)


@dataclass(frozen=True, slots=True)
class Transition:
    """A health change this worker made (its CAS changed the row)."""

    node_id: int
    previous: str
    current: str
    check: str
    reason: str


def decide(streaks: Mapping[str, Streak], thresholds: Thresholds) -> str | None:
    """The health the streaks call for, or None while they are inconclusive."""
    if any(streak.failures >= thresholds.failures for streak in streaks.values()):
        return HealthChoices.UNHEALTHY
    if streaks and all(streak.successes >= thresholds.successes for streak in streaks.values()):
        return HealthChoices.HEALTHY
    return None


def record_outcomes(
    client: redis.Redis,
    keys: RedisKeys,
    check: str,
    outcomes: list[Outcome],
    thresholds: Thresholds | None = None,
) -> list[Transition]:
    """Fold one round of outcomes into the streaks and apply the transitions they call for.

    Writes the streaks (Redis) and the transitions (database) only; the caller writes live state.
    """
    if not outcomes:
        return []
    thresholds = thresholds or Thresholds.from_settings()
    private = telemetry_keys(keys)
    script = client.register_script(_RECORD_OUTCOME)
    with client.pipeline(transaction=False) as pipe:
        for outcome in outcomes:
            script(
                keys=[private.health_streaks(outcome.node_id)],
                args=[check, "1" if outcome.ok else "0", STATE_TTL_S],
                client=pipe,
            )
        replies = pipe.execute()
    wanted: dict[int, tuple[str, str]] = {}
    for outcome, reply in zip(outcomes, replies, strict=True):
        streaks = _streaks(reply)
        target = decide(streaks, thresholds)
        if target is not None:
            wanted[outcome.node_id] = (target, _reason(target, streaks, outcome, thresholds))
    if not wanted:
        return []

    current = _health_rows(wanted)
    transitions = []
    for node_id, (target, reason) in wanted.items():
        row = current.get(node_id)
        if row is None or row.health == target:
            continue
        transition = apply_transition(row, target, check, reason)
        if transition is not None:
            transitions.append(transition)
    return transitions


def apply_transition(row: NodeHealth, target: str, check: str, reason: str) -> Transition | None:
    """Compare-and-swap ``row`` from its current health to ``target``; record the event if it won."""
    now = timezone.now()
    with transaction.atomic():
        changed = NodeHealth.objects.filter(pk=row.pk, health=row.health).update(
            health=target, changed_at=now, reason=reason[:300]
        )
        if changed != 1:
            return None  # another worker moved it first: theirs is the transition
        HealthEvent.objects.create(
            node_id=row.node_id,
            ts=now,
            previous=row.health,
            current=target,
            source=check,
            reason=reason[:300],
        )
    log.info("node %s: %s -> %s (%s: %s)", row.node_id, row.health, target, check, reason)
    return Transition(node_id=row.node_id, previous=row.health, current=target, check=check, reason=reason)


def live_patches(transitions: list[Transition]) -> dict[int, dict[str, bool]]:
    """The ``NodeLiveState`` fields these transitions change (the gateways route on ``healthy``)."""
    return {t.node_id: {"healthy": healthy_for_gateways(t.current)} for t in transitions}


def push_transitions(transitions: list[Transition]) -> None:
    """Tell the dashboard about each transition (once: only the worker whose CAS won has it)."""
    if not transitions:
        return
    names = dict(Node.objects.filter(pk__in=[t.node_id for t in transitions]).values_list("pk", "name"))
    now = timezone.now().timestamp()
    for t in transitions:
        push_dashboard(
            HealthUpdate(
                ts=now,
                node_id=t.node_id,
                node=names.get(t.node_id, str(t.node_id)),
                previous=t.previous,
                current=t.current,
                source=t.check,
                reason=t.reason,
            )
        )


def healthy_for_gateways(health: str | None) -> bool:
    """What ``NodeLiveState.healthy`` says for a health value: only "unhealthy" keeps traffic away."""
    return health != HealthChoices.UNHEALTHY


def health_by_node(node_ids: list[int]) -> dict[int, str]:
    return dict(NodeHealth.objects.filter(node_id__in=node_ids).values_list("node_id", "health"))


def _health_rows(wanted: Mapping[int, object]) -> dict[int, NodeHealth]:
    """The health rows of these nodes, created (unknown) where missing; deleted nodes are left out."""
    rows = {row.node_id: row for row in NodeHealth.objects.filter(node_id__in=wanted)}
    missing = [
        node_id
        for node_id in Node.objects.filter(pk__in=wanted).values_list("pk", flat=True)
        if node_id not in rows
    ]
    if missing:
        try:
            NodeHealth.objects.bulk_create(
                [NodeHealth(node_id=node_id) for node_id in missing], ignore_conflicts=True
            )
        except IntegrityError:  # a node was deleted meanwhile
            pass
        rows.update({row.node_id: row for row in NodeHealth.objects.filter(node_id__in=missing)})
    return rows


def _streaks(reply: list[bytes]) -> dict[str, Streak]:
    flat = [item.decode() if isinstance(item, bytes) else str(item) for item in reply]
    values = dict(zip(flat[::2], flat[1::2], strict=True))
    streaks = {}
    for check in CheckChoices.values:
        if f"{check}:ok" in values or f"{check}:fail" in values:
            streaks[check] = Streak(
                successes=int(values.get(f"{check}:ok", 0)), failures=int(values.get(f"{check}:fail", 0))
            )
    return streaks


def _reason(target: str, streaks: Mapping[str, Streak], outcome: Outcome, thresholds: Thresholds) -> str:
    if target == HealthChoices.HEALTHY:
        return f"{thresholds.successes}+ consecutive successful " + " and ".join(
            f"{c}s" for c in sorted(streaks)
        )
    failing = sorted(c for c, streak in streaks.items() if streak.failures >= thresholds.failures)
    text = " and ".join(f"{streaks[c].failures} consecutive failed {c}s" for c in failing)
    return f"{text}: {outcome.reason}" if outcome.reason and not outcome.ok else text
