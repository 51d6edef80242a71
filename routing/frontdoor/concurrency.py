"""A client key's ``max_concurrent``, held across every gateway of the fleet by leased slots.

Redis may be a WAN round trip away (120-235 ms from another region), so the request path must not
ask it per request. Each gateway instead **leases slots**: a share of the key's ``max_concurrent``
recorded in one Redis hash per key (field: its gateway id; value: ``slots:expires_ms``, Redis's
clock). One Lua call sets a gateway's lease to an absolute number of slots, granted only from what
the other gateways' unexpired leases leave free, so the leases of the fleet never sum past the
limit.

- **Admit**: a request is admitted from memory while this gateway has fewer requests open than
  slots leased (no I/O: the steady state). Only a request that finds the lease used up asks Redis
  (one round trip) for ``open + 1`` slots plus headroom, at least twice its lease (so a burst ramps
  up in a few calls); requests that miss while that call is out
  wait for it and share it. A call capped by the other gateways' leases refuses what it could not
  cover; waiters it did not cover are refused without another call.
- **Release**: the local count falls; the slot stays leased here, so the next request reuses it
  without a call.
- **Renew** (background, every ``renew_s``): each lease is resized to what recent local demand
  needs: the peak of open requests over the last window plus headroom, never below the requests
  open. The headroom is a quarter of that demand or, when larger, a quarter of the slots the fleet
  left free at the last call (the limit minus the other gateways' leases minus this demand), at
  most a quarter of the limit: far from the limit a gateway holds enough to absorb a burst
  without a round trip (at 120-235 ms from Redis, a ramp of doubling calls made every request of
  a burst wait; ``benchmarks/routing_quality.py --shared-state wan --front-door`` measured it),
  and as the fleet nears the limit the headroom shrinks to a quarter of the demand; a lease already that size is rewritten
  only once a third of its ttl has passed. Idle slots thus go back to the fleet within two windows,
  and a live lease never expires. A lease not renewed for ``lease_ttl_s`` (its gateway
  died) expires in Redis and its slots are free again.

**Tolerance.** With Redis reachable the fleet never has more than ``max_concurrent`` requests of a
key open: a gateway admits only within slots its lease holds, the script is atomic, one call per
key and gateway is in flight at a time (so a gateway's writes cannot overtake each other), and a
lease shrinks locally before the call that shrinks it in Redis and grows only after. Two ways past
the limit, both bounded: (1) while Redis is unreachable each gateway enforces the limit on its own
count (a fleet of N admits at most N times the limit, as before leases; never "unlimited"; Redis is
then skipped for ``retry_after_s``); (2) if this gateway cannot renew for longer than
``lease_ttl_s`` its lease expires while its requests are still open, and the others may admit up to
that many more (only during such an outage, which is case 1). The price in the other direction: a
gateway's unused slots (headroom, and slots released since the last renewal) are unavailable to
the other gateways for up to two ``renew_s`` windows, so near the limit another gateway may refuse
a request while that many slots sit idle here (at most a quarter of what was free at the last
call: with N gateways idle, (N / (N + 3)) of the free slots are leased as headroom).

**Redis losing the leases** (restarted empty, flushed, failed over to an empty replica): the first
gateway to call would see no other lease and take the limit while the others admit from the
leases they still hold. The limits' epoch (``RedisKeys.limits_epoch``, no expiry) tells a lost
namespace from a new one: a call from a gateway that had seen an epoch and finds none writes a new
one with a recovery window, within which no lease grows past what its gateway holds or has open.
A renewal with no call to make reads the epoch, so every live gateway re-asserts its leases within
the window (``retry_after_s`` + two renewals + 0.5 s).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

from redis.asyncio import Redis
from redis.exceptions import RedisError

from routing.background import Flag, sleep_unless, stop_tasks
from routing.contract import ClientKeySpec, RedisKeys
from routing.frontdoor.ratelimit import RedisBackoff, warm

logger = logging.getLogger("routing.concurrency")

# KEYS[1]: the key's lease hash; KEYS[2]: the limits' epoch. ARGV: this gateway's id, slots in use
# here (kept whatever the answer: those requests are open), slots wanted (>= in use), the limit,
# lease ttl ms, the epoch this gateway last saw ('' for none), the recovery window ms, slots this
# gateway leases now (as far as it knows).
# Returns {slots now leased to this gateway, slots the other gateways lease, the epoch}.
#
# The epoch tells a new namespace from a lost one. Missing and this gateway had seen one: Redis
# lost every lease while the gateways still admit from theirs, so for the recovery window no lease
# grows past what its gateway holds (or has open); each live gateway re-asserts its lease within
# it, and only then can a new one be sized on what they leave free.
_LEASE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local epoch = redis.call('GET', KEYS[2])
if not epoch then
  local recovering_until = 0
  if ARGV[6] ~= '' then recovering_until = now + tonumber(ARGV[7]) end
  epoch = ARGV[1] .. '@' .. now .. ':' .. recovering_until
  redis.call('SET', KEYS[2], epoch)
end
local others = 0
local fields = redis.call('HGETALL', KEYS[1])
for i = 1, #fields, 2 do
  if fields[i] ~= ARGV[1] then
    local slots, expires = string.match(fields[i + 1], '^(%d+):(%d+)$')
    if slots and tonumber(expires) > now then
      others = others + tonumber(slots)
    else
      redis.call('HDEL', KEYS[1], fields[i])
    end
  end
end
local in_use = tonumber(ARGV[2])
local wanted = tonumber(ARGV[3])
if tonumber(string.match(epoch, ':(%d+)$') or '0') > now then
  wanted = math.min(wanted, math.max(in_use, tonumber(ARGV[8])))
end
local held = math.min(wanted, tonumber(ARGV[4]) - others)
if held < in_use then held = in_use end
local ttl = tonumber(ARGV[5])
if held <= 0 then
  redis.call('HDEL', KEYS[1], ARGV[1])
  return {0, others, epoch}
end
redis.call('HSET', KEYS[1], ARGV[1], held .. ':' .. (now + ttl))
redis.call('PEXPIRE', KEYS[1], ttl + 1000)
return {held, others, epoch}
"""


class _Slots:
    """One key's slots at this gateway: requests open, slots leased, and the one call in flight."""

    __slots__ = ("call", "held", "limit", "open", "others", "peak", "valid_until", "waiting")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0  # requests open here
        self.held = 0  # slots leased (as Redis last confirmed, or less: a shrink counts at once)
        self.others = 0  # slots the other gateways leased, at the last call
        self.valid_until = 0.0  # clock: the lease is not trusted past this without a renewal
        self.peak = 0  # most requests open at once since the last renewal
        self.waiting = 0  # requests waiting for the call in flight
        self.call: asyncio.Future[bool] | None = None  # result: True when capped by the others


class ConcurrencyLimiter:
    """Open requests per key, admitted from slots leased from the fleet-wide limit in Redis."""

    def __init__(
        self,
        redis: Redis,
        keys: RedisKeys,
        gateway_id: str,
        *,
        lease_ttl_s: float = 10.0,
        renew_s: float = 0.5,
        headroom_fraction: float = 0.25,
        retry_after_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._gateway_id = gateway_id
        self._ttl_s = lease_ttl_s
        self._renew_s = renew_s
        self._headroom_fraction = headroom_fraction
        self._clock = clock
        self.backoff = RedisBackoff(retry_after_s, "concurrency limits")
        self._lease = redis.register_script(_LEASE)
        self._epoch = b""  # the limits' epoch at the last call ("": none seen yet)
        self._lost = False  # a call found a new epoch: the next renewal re-asserts every lease
        # Long enough for every live gateway to re-assert its lease after Redis lost them: back
        # from its backoff (Redis was down while it restarted), then its next renewal and its call.
        self._recovery_ms = int((retry_after_s + 2 * renew_s + 0.5) * 1000)
        self.slots: dict[str, _Slots] = {}
        self._closing = Flag()
        self._task: asyncio.Task[None] | None = None
        self._warming: asyncio.Task[None] | None = None
        self.fallbacks = 0  # admissions decided by this gateway's own count: Redis unreachable
        self.calls = 0  # lease calls made (misses and renewals)

    @property
    def open(self) -> dict[str, int]:
        """Key id -> requests open in this gateway."""
        return {key_id: slots.open for key_id, slots in self.slots.items()}

    def _wanted(self, slots: _Slots, need: int) -> int:
        """Slots to ask for when ``need`` are needed now: recent demand plus headroom, within the limit.

        The headroom: a share of the demand, or of the slots the fleet left free, the larger (see
        the module's docstring); none for a key with no demand, so an idle key's lease goes back.
        """
        demand = max(need, slots.peak)
        if demand == 0:
            return 0
        free = max(0, slots.limit - slots.others - demand)
        headroom = min(
            max(math.ceil(demand * self._headroom_fraction), math.floor(free * self._headroom_fraction)),
            slots.limit // 4,
        )
        return min(slots.limit, max(need, demand + headroom))

    def _take(self, slots: _Slots) -> bool:
        slots.open += 1
        slots.peak = max(slots.peak, slots.open)
        return True

    def _leased_slot_free(self, slots: _Slots, now: float) -> bool:
        return slots.open < slots.held and now < slots.valid_until

    def _slots_for(self, key: ClientKeySpec, limit: int) -> _Slots:
        slots = self.slots.get(key.id)
        if slots is None:
            slots = self.slots[key.id] = _Slots(limit)
        slots.limit = limit  # a new key set may change it; the next call uses the new one
        return slots

    async def acquire(self, key: ClientKeySpec) -> bool:
        """Take a slot of ``key`` (which has a ``max_concurrent``); ``False`` when all are in use."""
        limit = key.max_concurrent
        assert limit is not None
        slots = self._slots_for(key, limit)
        while True:
            if slots.open >= limit:
                return False  # this gateway alone is at the limit: no need to ask
            now = self._clock()
            if self._leased_slot_free(slots, now):
                return self._take(slots)  # the common case: no I/O
            if not self.backoff.up(now):
                self.fallbacks += 1  # this gateway's own count decides
                return self._take(slots)
            call = slots.call
            if call is None:
                return await self._miss(slots, key.id, now)
            slots.waiting += 1
            try:
                # shield: a waiter whose client left must not cancel the call the others wait for.
                capped = await asyncio.shield(call)
            finally:
                slots.waiting -= 1
            if capped and not self._leased_slot_free(slots, self._clock()):
                return False  # the fleet's leases left nothing: no second call for the same answer

    async def _miss(self, slots: _Slots, key_id: str, now: float) -> bool:
        """The one lease call for this key: grows the lease for this request and its waiters."""
        call: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        slots.call = call
        capped = False
        try:
            # At least double the lease on a miss: a burst ramps up in a few calls, not one call
            # per request it brings (renewals shrink what it does not use).
            wanted = max(
                self._wanted(slots, slots.open + 1 + slots.waiting), min(slots.limit, 2 * slots.held)
            )
            try:
                held = await self._call(key_id, slots, wanted)
            except (RedisError, OSError, TimeoutError) as exc:
                self.backoff.failed(now, exc)
                self.fallbacks += 1
                return self._take(slots)
            self.backoff.succeeded()
            slots.held = held
            slots.valid_until = now + self._ttl_s  # Redis's expiry is later: it started after `now`
            capped = held < wanted
            if slots.open < slots.held:
                return self._take(slots)
            return False
        finally:
            slots.call = None
            call.set_result(capped)

    async def _call(self, key_id: str, slots: _Slots, wanted: int) -> int:
        self.calls += 1
        # The client's own socket timeouts bound this (routing.frontdoor.ratelimit.make_limiter_redis).
        held, others, epoch = await self._lease(
            keys=[self._keys.concurrency(key_id), self._keys.limits_epoch],
            args=[
                self._gateway_id,
                slots.open,
                max(wanted, slots.open),
                slots.limit,
                int(self._ttl_s * 1000),
                self._epoch,
                self._recovery_ms,
                slots.held,
            ],
        )
        epoch = epoch.encode() if isinstance(epoch, str) else bytes(epoch)
        if epoch != self._epoch:
            self._lost = bool(self._epoch)  # a new epoch after one seen: the other leases re-assert too
            self._epoch = epoch
        slots.others = int(others)
        return int(held)

    def release(self, key: ClientKeySpec) -> None:
        slots = self.slots.get(key.id)
        if slots is not None and slots.open > 0:
            slots.open -= 1  # the slot stays leased here: the next request reuses it

    # ---- background ----------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="gorgo-concurrency-leases")
        self._warming = asyncio.create_task(warm(self._redis, self._lease), name="gorgo-concurrency-warm")

    async def close(self) -> None:
        """Give every slot back (a lease of what is still open, usually none)."""
        self._closing.set()
        if self._warming is not None:
            await stop_tasks([self._warming], grace_s=1.0)
        if self._task is not None:
            await stop_tasks([self._task], grace_s=self._renew_s + 1.0)
        for slots in self.slots.values():
            slots.peak = 0
        await self.renew(final=True)

    async def _loop(self) -> None:
        while not await sleep_unless(self._closing, self._renew_s):
            await self.renew()

    async def renew(self, *, final: bool = False) -> None:
        """Resize every lease to recent demand (the peak since the last renewal plus headroom), or
        rewrite it when a third of its ttl has passed.

        One call per key that needs it, each the key's only call in flight; a key with a miss call out is
        skipped (that call renews it). Shrinks count locally before the call, so a failed call
        leaves Redis holding more for this gateway than it uses, never less.
        """
        now = self._clock()
        if not self.backoff.up(now):
            return
        lost = self._lost  # a call since the last renewal found the leases lost: re-assert them all
        self._lost = False
        due: list[tuple[str, _Slots, int]] = []
        kept: list[tuple[str, _Slots, int]] = []
        for key_id, slots in list(self.slots.items()):
            if slots.call is not None:
                continue
            wanted = slots.open if final else self._wanted(slots, slots.open)
            if wanted == 0 and slots.held == 0:
                if slots.open == 0 and slots.waiting == 0:
                    del self.slots[key_id]  # idle, nothing leased: forget it
                continue
            demand = max(slots.open, slots.peak)
            slots.peak = slots.open  # the next window starts from what is open now
            # Headroom taken from the free slots is sized on the other gateways' leases of the last
            # call: such a lease is re-sized every renewal, so it shrinks within two as they grow.
            from_free = wanted > min(slots.limit, demand + math.ceil(demand * self._headroom_fraction))
            if (
                not final
                and not from_free
                and wanted == slots.held
                and now < slots.valid_until - self._ttl_s * 2 / 3
            ):
                kept.append((key_id, slots, wanted))  # the right size, written within a third of its ttl
                continue
            slots.held = min(slots.held, wanted)  # a shrink counts here before Redis hears of it
            due.append((key_id, slots, wanted))
        if kept and not lost and not due and self._epoch:
            # No call this renewal: one read tells whether Redis lost the leases (restarted empty,
            # flushed, failed over), so they are re-asserted now, not at each one's next rewrite.
            try:
                epoch = await self._redis.get(self._keys.limits_epoch)
            except (RedisError, OSError, TimeoutError) as exc:
                self.backoff.failed(now, exc)
                return
            lost = (epoch.encode() if isinstance(epoch, str) else epoch) != self._epoch
        if lost:
            due.extend(entry for entry in kept if entry[1].call is None)
        if not due:
            return
        call: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        for _key_id, slots, _wanted in due:
            slots.call = call
        try:
            # Concurrently on the pool; the client's socket timeouts bound each call.
            results = await asyncio.gather(
                *(self._call(key_id, slots, wanted) for key_id, slots, wanted in due),
                return_exceptions=True,
            )
            failure = next((r for r in results if isinstance(r, BaseException)), None)
            if failure is not None:
                logger.debug("concurrency limits: renewal failed (%s)", failure)
                if not isinstance(failure, (RedisError, OSError, TimeoutError)):
                    raise failure
                self.backoff.failed(now, failure)
            else:
                self.backoff.succeeded()
            for (key_id, slots, _wanted), held in zip(due, results, strict=True):
                if isinstance(held, int):
                    slots.held = held
                    slots.valid_until = now + self._ttl_s
                if slots.held == 0 and slots.open == 0 and slots.waiting == 0:
                    self.slots.pop(key_id, None)
        finally:
            for _key_id, slots, _wanted in due:
                slots.call = None
            call.set_result(False)
