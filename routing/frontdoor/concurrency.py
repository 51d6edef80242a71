"""A client key's ``max_concurrent``, held across every gateway of the fleet.

Each gateway keeps the exact count of the requests it has open per key, and writes it to one Redis
hash per key (field: its gateway id; value: ``count:ms``, the count and Redis's clock when it was
written). Counts are absolute, never deltas, so a lost or reordered write is corrected by the next.

- **Admit** (keys with a ``max_concurrent`` only): one Lua call sums the other gateways' fresh
  counts (written within ``stale_s``), adds this gateway's own count including the new request,
  and when that is within the limit writes the new own count: one Redis round trip per request.
  A gateway that is already at the limit by itself refuses without asking Redis.
- **Release**: only the local count falls; the new count is written by the background flush
  (every ``flush_s``). A slot given back here is free here at once; elsewhere within a flush.
- **Heartbeat**: non-zero counts are written again every ``heartbeat_s`` (well under
  ``stale_s``), so a long stream keeps counting, and a gateway that dies stops counting after
  ``stale_s``.

Two admissions of one gateway may reach Redis out of order (the client pool has several
connections), leaving its field one request low until the next flush (``flush_s``): another
gateway may then admit one request over the limit in that window. When Redis is unreachable each
gateway enforces the limit on its own count (so a fleet of N admits at most N times the limit),
never "unlimited"; after a failure Redis is skipped for ``retry_after_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time

from redis.asyncio import Redis
from redis.exceptions import RedisError

from routing.background import sleep_unless, stop_tasks
from routing.contract import ClientKeySpec, RedisKeys
from routing.frontdoor.ratelimit import RedisBackoff

logger = logging.getLogger("routing.concurrency")

# KEYS[1]: the key's hash. ARGV: this gateway's id, its count with the new request, the limit,
# ms after which another gateway's count no longer counts. Returns {admitted (1/0), others' count}.
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local stale = tonumber(ARGV[4])
local others = 0
local fields = redis.call('HGETALL', KEYS[1])
for i = 1, #fields, 2 do
  if fields[i] ~= ARGV[1] then
    local count, at = string.match(fields[i + 1], '^(%d+):(%d+)$')
    if count and now - tonumber(at) <= stale then
      others = others + tonumber(count)
    else
      redis.call('HDEL', KEYS[1], fields[i])
    end
  end
end
if others + tonumber(ARGV[2]) > tonumber(ARGV[3]) then
  return {0, others}
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ':' .. now)
redis.call('PEXPIRE', KEYS[1], stale * 2)
return {1, others}
"""

# KEYS[1]: the key's hash. ARGV: this gateway's id, its count, stale ms. A zero count is removed.
_REPORT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if tonumber(ARGV[2]) == 0 then
  redis.call('HDEL', KEYS[1], ARGV[1])
else
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ':' .. now)
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]) * 2)
end
return 1
"""


class ConcurrencyLimiter:
    """Open requests per key: exact for this gateway, shared with the others through Redis."""

    def __init__(
        self,
        redis: Redis,
        keys: RedisKeys,
        gateway_id: str,
        *,
        stale_s: float = 30.0,
        heartbeat_s: float = 5.0,
        flush_s: float = 0.1,
        retry_after_s: float = 1.0,
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._gateway_id = gateway_id
        self._stale_ms = int(stale_s * 1000)
        self._heartbeat_s = heartbeat_s
        self._flush_s = flush_s
        self.backoff = RedisBackoff(retry_after_s, "concurrency limits")
        self._acquire = redis.register_script(_ACQUIRE)
        self._report = redis.register_script(_REPORT)
        self.open: dict[str, int] = {}  # key id -> requests open in this gateway
        self._dirty: set[str] = set()  # key ids whose count changed since the last flush
        self._closing = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.fallbacks = 0  # admissions decided locally because Redis was unreachable

    async def acquire(self, key: ClientKeySpec) -> bool:
        """Take a slot of ``key`` (which has a ``max_concurrent``); ``False`` when all are in use."""
        limit = key.max_concurrent
        assert limit is not None
        own = self.open.get(key.id, 0) + 1
        if own > limit:
            return False
        self.open[key.id] = own  # reserved before the await: concurrent admissions here see it
        now = time.monotonic()
        if self.backoff.up(now):
            try:
                # The client's own socket timeouts bound this (routing.frontdoor.ratelimit.make_limiter_redis).
                admitted, _others = await self._acquire(
                    keys=[self._keys.concurrency(key.id)],
                    args=[self._gateway_id, own, limit, self._stale_ms],
                )
            except (RedisError, OSError, TimeoutError) as exc:
                self.backoff.failed(now, exc)
            else:
                self.backoff.succeeded()
                if not admitted:
                    self.release(key)
                    return False
                return True
        self.fallbacks += 1  # this gateway's own count decided
        self._dirty.add(key.id)
        return True

    def release(self, key: ClientKeySpec) -> None:
        self.open[key.id] = self.open.get(key.id, 1) - 1
        self._dirty.add(key.id)

    # ---- background ----------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="gorgo-concurrency-report")

    async def close(self) -> None:
        self._closing.set()
        if self._task is not None:
            await stop_tasks([self._task], grace_s=self._flush_s + 1.0)
        self._dirty.update(self.open)  # say goodbye: zero counts are removed
        for key_id in self.open:
            self.open[key_id] = 0
        await self._flush()

    async def _loop(self) -> None:
        last_heartbeat = time.monotonic()
        while not await sleep_unless(self._closing, self._flush_s):
            now = time.monotonic()
            if now - last_heartbeat >= self._heartbeat_s:
                last_heartbeat = now
                self._dirty.update(key_id for key_id, count in self.open.items() if count)
            await self._flush()

    async def _flush(self) -> None:
        dirty, self._dirty = self._dirty, set()
        if not dirty or not self.backoff.up(time.monotonic()):
            self._dirty |= dirty
            return
        try:
            async with asyncio.timeout(1.0):
                async with self._redis.pipeline(transaction=False) as pipe:
                    for key_id in dirty:
                        count = self.open.get(key_id, 0)
                        await self._report(
                            keys=[self._keys.concurrency(key_id)],
                            args=[self._gateway_id, count, self._stale_ms],
                            client=pipe,
                        )
                    await pipe.execute()
        except (RedisError, OSError, TimeoutError) as exc:
            logger.debug("concurrency limits: report failed (%s); retrying", exc)
            self._dirty |= dirty
        for key_id in dirty:
            if self.open.get(key_id) == 0:
                del self.open[key_id]
