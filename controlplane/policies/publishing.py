"""Compile a routing policy with the fleet into a snapshot, and publish it to the gateways.

Publishing is all-or-nothing: the policy is validated, compiled and recorded as a PolicyVersion in
one database transaction, and the snapshot is written to Redis last inside that transaction; if the
Redis write fails the transaction rolls back, so no version exists that the gateways never saw.
The Redis write itself is the compare-and-set of ``routing/writer.py``: a snapshot only replaces an older
version, never a newer one, so two publishers racing cannot move the gateways backwards.

Publishes are serialized in the database: on PostgreSQL by a transaction-scoped advisory lock, on
SQLite by its one writer (``transaction_mode: IMMEDIATE`` takes the write lock at BEGIN). So the
version number, the active flag and Redis move together, one publish at a time; a publish that
still loses a race (a conflicting concurrent write the lock does not cover) answers 409, retry.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import msgspec
import redis
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import IntegrityError, connection, transaction
from django.db.models import Max
from django.utils import timezone

from controlplane.api import ConcurrentWriteError, ConflictError, UnavailableError
from controlplane.connections import redis_client, redis_keys
from controlplane.fleet.models import LLMModel, Node, Region
from controlplane.policies.choices import ExperimentStatusChoices
from controlplane.policies.models import PolicyExperiment, PolicyVersion, RoutingPolicy
from routing import contract, writer
from routing.contract import (
    PARAMS_BY_ALGORITHM,
    KVEventsSpec,
    ModelSpec,
    NodeSpec,
    PolicySnapshot,
    PolicySpec,
    RegionSpec,
    ResidencyRule,
    TokenizerSpec,
    TrialSpec,
)

log = logging.getLogger(__name__)

SYSTEM_AUTHOR = "system"
# pg_advisory_xact_lock key of "a publish is running" (any fixed 64-bit number; b"gorgo-pu").
_PUBLISH_LOCK_KEY = int.from_bytes(b"gorgo-pu", "big") >> 1


class PublishError(UnavailableError):
    """The snapshot could not be written to Redis; nothing was recorded (the API answers 503)."""

    code = "publish_failed"

    def __init__(self, message: str, public_detail: str | None = None) -> None:
        super().__init__(message)
        self.public_detail = (
            public_detail or "The policy store is unreachable; nothing was published. Try again shortly."
        )


@dataclass(frozen=True, slots=True)
class PublishResult:
    """What a publish did: the live version, whether it is new, and whether an unchanged one was
    written back to a Redis that had lost it."""

    version: PolicyVersion
    created: bool
    restored: bool = False


def compile_policy(policy: RoutingPolicy) -> PolicySnapshot:
    """Validate the policy as it is in the database and compile it with the current fleet.

    Raises ``ValidationError`` with field errors when the policy is invalid.
    """
    policy.full_clean()
    params = msgspec.convert(policy.params or {}, PARAMS_BY_ALGORITHM[policy.algorithm])
    spec = PolicySpec(
        id=policy.pk,
        name=policy.name,
        algorithm=policy.algorithm,
        params=params,
        model_scope=tuple(sorted(policy.model_scope.values_list("name", flat=True))) if policy.pk else (),
        residency=tuple(
            ResidencyRule(client_region=r["client_region"], node_regions=tuple(r["node_regions"]))
            for r in policy.residency
        ),
        max_rtt_ms=policy.max_rtt_ms,
    )
    return compile_spec(spec)


def compile_spec(spec: PolicySpec) -> PolicySnapshot:
    """Compile policy settings (already validated) with the current fleet into an unnumbered snapshot."""
    regions = tuple(
        RegionSpec(slug=r.slug, name=r.name, latitude=r.latitude, longitude=r.longitude)
        for r in Region.objects.order_by("slug")
    )
    models = tuple(
        ModelSpec(
            name=m.name,
            kv_block_size=m.kv_block_size,
            max_context_tokens=m.max_context_tokens,
            tokenizer=(
                TokenizerSpec(m.tokenizer_path, m.chat_template_path or None) if m.tokenizer_path else None
            ),
            lora_adapter=m.lora_adapter,
            model_folder=m.model_folder or None,
        )
        for m in LLMModel.objects.order_by("name")
    )
    nodes = tuple(
        NodeSpec(
            id=n.pk,
            name=n.name,
            region=n.region.slug,
            base_url=n.base_url,
            models=tuple(sorted(m.name for m in n.served_models.all())),
            gpu_type=n.gpu_type,
            gpu_count=n.gpu_count,
            max_num_seqs=n.max_num_seqs,
            prefill_tokens_per_s=n.prefill_tokens_per_s,
            kv_capacity_tokens=n.kv_capacity_tokens,
            state=n.state,
            labels={str(k): str(v) for k, v in sorted((n.labels or {}).items())},
            kv_events=(
                KVEventsSpec(n.kv_events_endpoint, n.kv_events_replay_endpoint or None, n.kv_events_topic)
                if n.kv_events_endpoint
                else None
            ),
        )
        for n in Node.objects.select_related("region").prefetch_related("served_models").order_by("pk")
    )
    trials = running_trials()
    content = PolicySnapshot(
        schema_version=contract.SCHEMA_VERSION,
        version=0,
        checksum="",
        published_at=0.0,
        policy=spec,
        regions=regions,
        models=models,
        nodes=nodes,
        **{kind: contract.encode_trial(trial) for kind, trial in trials.items()},
    )
    checksum = hashlib.sha256(contract.encode(content)).hexdigest()
    return msgspec.structs.replace(content, checksum=checksum)


def running_trials() -> dict[str, TrialSpec]:
    """The running experiments as the snapshot carries them, by kind (issue 23).

    Every publish compiles them in, so a fleet change, a reconcile or another policy's publish
    keeps a running shadow or canary on the gateways; only stopping it takes it out.
    """
    return {
        experiment.kind: TrialSpec(
            id=experiment.pk,
            kind=experiment.kind,
            policy=experiment.trial_policy(),
            source_version=experiment.source_version.number if experiment.source_version else None,
            share=(experiment.share_percent or 0.0) / 100,
            salt=experiment.salt,
        )
        for experiment in PolicyExperiment.objects.filter(
            status=ExperimentStatusChoices.RUNNING
        ).select_related("source_version")
    }


def live_version() -> PolicyVersion | None:
    """The version the gateways are running (the newest published one)."""
    return (
        PolicyVersion.objects.filter(published_at__isnull=False)
        .select_related("policy")
        .order_by("-number")
        .first()
    )


def write_snapshot(snapshot: PolicySnapshot) -> bool:
    """Write a snapshot to Redis and announce it, unless Redis holds a newer one. Raises PublishError."""
    try:
        return writer.write(redis_client(), redis_keys(), snapshot)
    except redis.RedisError as exc:
        raise PublishError(f"could not write the snapshot to Redis: {exc}") from exc


def publish(
    policy: RoutingPolicy,
    *,
    author: AbstractBaseUser | None = None,
    note: str = "",
    rolled_back_from: PolicyVersion | None = None,
    spec: PolicySpec | None = None,
    system_author: str = SYSTEM_AUTHOR,
    reviewed_checksum: str | None = None,
) -> PublishResult:
    """Compile and publish ``policy``; make it the active one.

    ``spec`` publishes those settings of the policy instead of its database row (``republish_live``).
    ``system_author`` names the version's author when no user publishes (the online tuner).
    ``reviewed_checksum``: publish only that compiled content (``ConflictError``, 409, otherwise).
    Publishing what is already live creates no version (but heals Redis if it lost the snapshot).
    Raises ``ValidationError`` (invalid policy) or ``PublishError`` (Redis unreachable); in both
    cases nothing changes.
    """
    for _attempt in range(3):
        try:
            return _publish_once(
                policy,
                author=author,
                note=note,
                rolled_back_from=rolled_back_from,
                spec=spec,
                system_author=system_author,
                reviewed_checksum=reviewed_checksum,
            )
        except IntegrityError:
            # Another publisher took the same version number first: compile again on top of it.
            continue
    raise ConcurrentWriteError("Too many concurrent publishes; nothing was published. Try again.")


def lock_publishes() -> None:
    """Wait for any other publish to commit or roll back (held until this transaction ends).

    A publish locks the policies' rows after this (their active flag): a caller that also locks a
    policy row takes this first, or it could deadlock with a publish.
    """
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [_PUBLISH_LOCK_KEY])
    # SQLite: the IMMEDIATE transaction already holds the database's one write lock.


def _publish_once(
    policy: RoutingPolicy,
    *,
    author: AbstractBaseUser | None,
    note: str,
    rolled_back_from: PolicyVersion | None,
    spec: PolicySpec | None,
    system_author: str = SYSTEM_AUTHOR,
    reviewed_checksum: str | None = None,
) -> PublishResult:
    with transaction.atomic():
        lock_publishes()
        content = compile_policy(policy) if spec is None else compile_spec(spec)
        # Compared with what this publish compiled under the lock: compared before it, a fleet
        # change committed while it waited went live unreviewed.
        if reviewed_checksum and content.checksum != reviewed_checksum:
            raise ConflictError("The policy or the fleet changed since that checksum; review the diff again.")
        live = live_version()
        if live is not None and live.checksum == content.checksum and live.policy_id == policy.pk:
            return PublishResult(version=live, created=False, restored=_ensure_live_in_redis(live))
        # Above both the database's and Redis's newest: after a database restore the gateways may
        # run a higher version than any we remember, and a lower number would never go live.
        number = max(PolicyVersion.objects.aggregate(top=Max("number"))["top"] or 0, _redis_version()) + 1
        now = timezone.now()
        snapshot = msgspec.structs.replace(content, version=number, published_at=now.timestamp())
        version = PolicyVersion.objects.create(
            policy=policy,
            number=number,
            checksum=snapshot.checksum,
            snapshot=contract.encode(snapshot).decode(),
            author=author if author is not None and author.is_authenticated else None,
            author_name=(
                author.get_username() if author is not None and author.is_authenticated else system_author
            ),
            note=note[:500],
            rolled_back_from=rolled_back_from,
            published_at=now,
        )
        RoutingPolicy.objects.filter(is_active=True).exclude(pk=policy.pk).update(is_active=False)
        if RoutingPolicy.objects.filter(pk=policy.pk).update(is_active=True) != 1:
            raise ConcurrentWriteError(f"Policy {policy.name} was deleted meanwhile; nothing was published.")
        policy.is_active = True
        # Last: a failure here rolls the whole transaction back.
        if not write_snapshot(snapshot):
            raise IntegrityError(f"Redis already holds a snapshot newer than version {number}")
    log.info("published %s as version %d (%s)", policy.name, number, snapshot.checksum[:12])
    return PublishResult(version=version, created=True)


def _redis_version() -> int:
    """The version of the snapshot the gateways run now (0 when there is none)."""
    try:
        return writer.current_version(redis_client(), redis_keys())
    except redis.RedisError as exc:
        raise PublishError(f"could not read the live snapshot from Redis: {exc}") from exc


def _ensure_live_in_redis(live: PolicyVersion) -> bool:
    """Write the live version back when Redis lost it (or holds another); True when written."""
    keys = redis_keys()
    try:
        current = redis_client().get(keys.policy_current)
    except redis.RedisError as exc:
        raise PublishError(f"could not read the live snapshot from Redis: {exc}") from exc
    if current is None or msgspec.json.decode(current).get("version") != live.number:
        return write_snapshot(live.compiled())
    return False


def rollback(
    version: PolicyVersion, *, author: AbstractBaseUser | None = None, note: str = ""
) -> PublishResult:
    """Restore the policy settings of an earlier version and publish them with the current fleet."""
    spec = version.compiled().policy
    with transaction.atomic():
        # The publish lock before the policy's row, as a publish takes them: the other way round, a
        # publish of another policy (holding the lock, clearing this one's active flag) deadlocked.
        lock_publishes()
        policy = RoutingPolicy.objects.select_for_update().get(pk=version.policy_id)
        policy.algorithm = spec.algorithm
        policy.params = msgspec.to_builtins(spec.params)
        policy.params.pop("type", None)  # the union tag: the algorithm field says it already
        policy.residency = [
            {"client_region": r.client_region, "node_regions": list(r.node_regions)} for r in spec.residency
        ]
        policy.max_rtt_ms = spec.max_rtt_ms
        missing = set(spec.model_scope) - set(
            LLMModel.objects.filter(name__in=spec.model_scope).values_list("name", flat=True)
        )
        if missing:
            raise ValidationError({"model_scope": f"Models no longer exist: {', '.join(sorted(missing))}."})
        policy.save()
        policy.model_scope.set(LLMModel.objects.filter(name__in=spec.model_scope))
        return publish(
            policy,
            author=author,
            note=note or f"rollback to v{version.number}",
            rolled_back_from=version,
        )


def republish_live(note: str) -> PublishResult | None:
    """Publish what is live again, compiled with the current fleet (no-op if nothing changed).

    The policy settings come from the last *published* version, never from the database row: an
    edit nobody published (or whose publish was refused while Redis was down) stays unpublished.
    Returns None when nothing was ever published.
    """
    with transaction.atomic():
        # What is live is read under the publish lock: read before it, a publish of another policy
        # committing meanwhile was published over with the policy it had replaced.
        lock_publishes()
        live = live_version()
        if live is None:
            return None
        spec = live.compiled().policy
        return publish(live.policy, note=note, spec=spec)


def republish_active(reason: str) -> PublishResult | None:
    """Republish the live policy after a fleet change (no-op if nothing changed)."""
    return republish_live(f"fleet change: {reason}")
