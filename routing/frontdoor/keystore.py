"""The gateway's copy of the client key set, kept current from Redis in the background.

Like the policy: loaded at start (bounded in time), swapped within a second of an announcement on
``key_channel``, re-read every ``refresh_s`` as a safety net, and kept as it is while Redis is away
(the last good set: a revoked key stays refused, a valid key keeps working). A set with an unknown
schema version or that does not decode is refused and the old one kept.

Last use is recorded cheaply: a request adds its key's id to a set; every ``refresh_s`` the ids
seen are stamped with the time and written by one HSET, never on the request path.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time

import msgspec
from redis.asyncio import Redis
from redis.exceptions import RedisError

from routing.background import Flag, run_bounded, sleep_unless, stop_tasks
from routing.contract import ClientKeySet, ClientKeySpec, RedisKeys, UnknownSchemaVersion, decode

logger = logging.getLogger("routing.keys")

_STARTUP_TIMEOUT_S = 2.0
_PUBSUB_POLL_S = 0.25
_MIN_BACKOFF_S = 0.1
_MAX_BACKOFF_S = 5.0


def secret_hash(secret: str) -> str:
    """How a presented secret is looked up: its sha256, as the control plane stores it."""
    return hashlib.sha256(secret.encode()).hexdigest()


class KeyStore:
    """Secret hash -> ``ClientKeySpec``, from the newest key set Redis had."""

    def __init__(
        self,
        redis: Redis,
        keys: RedisKeys,
        *,
        refresh_s: float = 5.0,
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._refresh_s = refresh_s
        self.by_hash: dict[str, ClientKeySpec] = {}
        self.version: int | None = None
        self.loaded = asyncio.Event()
        # Ids of the keys used since the last write of their last-use times: the request path
        # only adds to this set; the refresh loop stamps and writes them every ``refresh_s``.
        self.used: set[str] = set()
        self._last_used_pending: dict[str, float] = {}  # key id -> unix seconds, to write
        self._closing = Flag()
        self._tasks: list[asyncio.Task[None]] = []

    # ---- the request path -----------------------------------------------------------------

    def lookup(self, secret: str) -> ClientKeySpec | None:
        return self.by_hash.get(secret_hash(secret))

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        try:
            async with asyncio.timeout(_STARTUP_TIMEOUT_S):
                await self.reload()
        except (TimeoutError, RedisError, OSError) as exc:
            logger.error("keys: Redis unreachable at start (%s); every key is refused until it is back", exc)
        self._tasks = [
            asyncio.create_task(self._listen(), name="gorgo-keys-listen"),
            asyncio.create_task(self._refresh_and_flush(), name="gorgo-keys-refresh"),
        ]

    async def close(self) -> None:
        self._closing.set()
        tasks, self._tasks = self._tasks, []
        await stop_tasks(tasks, grace_s=_PUBSUB_POLL_S + 1.0)
        await run_bounded(self._flush_last_used(), 1.0, "gorgo-keys-last-used")

    # ---- loading ----------------------------------------------------------------------------

    async def reload(self) -> bool:
        """GET the key set and swap to it when it is newer; ``False`` when absent or refused."""
        raw = await self._redis.get(self._keys.key_set)
        if raw is None:
            self.loaded.set()
            return False
        try:
            key_set = decode(raw, ClientKeySet)
        except (UnknownSchemaVersion, msgspec.ValidationError, msgspec.DecodeError) as exc:
            logger.error("keys: refused a key set (%s); keeping version %s", exc, self.version)
            return False
        if self.version is not None and key_set.version <= self.version:
            return False
        self.by_hash = {spec.secret_sha256: spec for spec in key_set.keys}
        self.version = key_set.version
        self.loaded.set()
        logger.info("keys: version %s, %d key(s)", key_set.version, len(key_set.keys))
        return True

    async def _listen(self) -> None:
        backoff_s = _MIN_BACKOFF_S
        while not self._closing.is_set():
            pubsub = self._redis.pubsub()
            try:
                await pubsub.subscribe(self._keys.key_channel)
                await self.reload()  # what was announced while we were away is lost by pub/sub
                backoff_s = _MIN_BACKOFF_S
                while not self._closing.is_set():
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=_PUBSUB_POLL_S)
                    if message is not None:
                        await self.reload()
            except (RedisError, OSError) as exc:
                logger.warning("keys: lost Redis (%s); keeping key set version %s", exc, self.version)
                await sleep_unless(self._closing, backoff_s)
                backoff_s = min(backoff_s * 2, _MAX_BACKOFF_S)
            finally:
                await run_bounded(pubsub.aclose(), 1.0, "gorgo-keys-pubsub-close")

    async def _refresh_and_flush(self) -> None:
        while not await sleep_unless(self._closing, self._refresh_s):
            try:
                await self.reload()
                await self._flush_last_used()
            except (RedisError, OSError) as exc:
                logger.debug("keys: refresh failed (%s)", exc)

    async def _flush_last_used(self) -> None:
        used, self.used = self.used, set()
        now = time.time()
        for key_id in used:
            self._last_used_pending[key_id] = now
        pending, self._last_used_pending = self._last_used_pending, {}
        if not pending:
            return
        try:
            await self._redis.hset(self._keys.key_last_used, mapping=pending)  # type: ignore[arg-type]
        except (RedisError, OSError):
            self._last_used_pending = {**pending, **self._last_used_pending}  # next time
            raise
