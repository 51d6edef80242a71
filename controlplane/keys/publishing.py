"""Write every client key (hashes, limits, state; never a secret) to Redis for the gateways.

The whole set is written on each change, compare-and-set by version through ``routing.writer``,
and announced; gateways swap it within a second and keep the last good set while Redis is away.
The version is taken *before* reading the database, so of two racing writers the one that read
later (and saw more) carries the larger version and wins.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime

import redis
from django.db import transaction

from controlplane.connections import redis_client, redis_keys
from controlplane.keys.models import ClientKey
from routing import writer
from routing.contract import SCHEMA_VERSION, ClientKeySet, ClientKeySpec

log = logging.getLogger(__name__)


class KeyPublishError(Exception):
    """The key set could not be written to Redis (the database change itself is kept)."""


def build_key_set(version: int) -> ClientKeySet:
    specs = []
    for key in ClientKey.objects.prefetch_related("allowed_models", "allowed_regions").order_by("key_id"):
        specs.append(
            ClientKeySpec(
                id=key.key_id,
                secret_sha256=key.secret_sha256,
                owner=key.owner,
                team=key.team,
                models=tuple(sorted(model.name for model in key.allowed_models.all())),
                regions=tuple(sorted(region.slug for region in key.allowed_regions.all())),
                requests_per_min=key.requests_per_min,
                tokens_per_min=key.tokens_per_min,
                max_concurrent=key.max_concurrent,
                priority=key.priority,  # type: ignore[arg-type]
                expires_at=key.expires_at.timestamp() if key.expires_at else None,
                revoked=key.revoked,
            )
        )
    return ClientKeySet(
        schema_version=SCHEMA_VERSION, version=version, written_at=time.time(), keys=tuple(specs)
    )


def publish_keys() -> ClientKeySet:
    """Write the current key set to Redis and announce it; raise ``KeyPublishError`` if Redis fails."""
    version = time.time_ns() // 1000  # microseconds: taken before the read, see the module docstring
    key_set = build_key_set(version)
    try:
        writer.write(redis_client(), redis_keys(), key_set)
    except redis.RedisError as exc:
        raise KeyPublishError(
            f"Redis is unreachable; the key change is saved but not yet live ({exc})"
        ) from exc
    return key_set


@dataclass(frozen=True, slots=True)
class _PublishAfterCommit:
    """The on-commit callback that publishes the key set (its type marks it as already queued)."""

    reason: str

    def __call__(self) -> None:
        try:
            publish_keys()
        except KeyPublishError as exc:
            log.warning(
                "client keys (%s): %s; run `manage.py publish_keys` once Redis is back", self.reason, exc
            )
        except Exception:
            log.exception("client keys (%s) could not be published", self.reason)


def publish_keys_on_commit(reason: str) -> None:
    """After the current transaction commits, publish the key set once (a key saved with its
    models and regions fires several signals); a failure is logged, not raised.

    "Already queued" is read from the connection's own on-commit list, which Django empties when
    the transaction rolls back: a flag of our own would stay set after a rollback and silence
    every later change in that thread."""
    pending = transaction.get_connection().run_on_commit
    if any(isinstance(callback, _PublishAfterCommit) for _savepoints, callback, _robust in pending):
        return
    transaction.on_commit(_PublishAfterCommit(reason))


def sync_last_used() -> None:
    """Copy the gateways' last-used times (a Redis hash) into the keys; quiet when Redis is away."""
    try:
        seen = writer.read_last_used(redis_client(), redis_keys())
    except redis.RedisError:
        return
    if not seen:
        return
    for key in ClientKey.objects.filter(key_id__in=list(seen)):
        used_at = datetime.fromtimestamp(seen[key.key_id], tz=UTC)
        if key.last_used_at is None or used_at > key.last_used_at:
            # Compare-and-set: a concurrent sync that wrote a later time wins.
            ClientKey.objects.filter(pk=key.pk, last_used_at=key.last_used_at).update(last_used_at=used_at)
