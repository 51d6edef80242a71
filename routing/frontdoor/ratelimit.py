"""Per-key request and token rate limits, shared by every gateway through Redis.

Two token buckets per key (requests per minute, tokens per minute) in one Redis hash, checked and
charged atomically by one Lua script. A call also leases the gateway a slice of the limits
(``lease_fraction`` of a minute's), spent from memory and refilled in the background once half is
gone, so a busy key's requests do not wait for Redis (issue 24: Redis may be a WAN round trip
away); none for a key without limits.
The clock is Redis's (``TIME``), so gateways with skewed clocks share one notion of "now". A bucket
holds at most a minute's allowance and refills continuously; an idle key's hash expires.

Tokens are charged up front from the prompt estimate, then settled with the node's ``usage``
(prompt + completion) in batches off the request path; a bucket may go negative after a long
answer, which makes the key wait.

When Redis is unreachable (or slower than ``GORGO_RATELIMIT_REDIS_TIMEOUT_S``), each gateway enforces the same limits on its
own (``LocalBuckets``), never "unlimited"; so during an outage a fleet of N gateways admits at most
N times a key's limit. What a gateway admits so is owed to the shared buckets and charged to them
(``_CHARGE``) at the first settle after Redis answers again. After a failure Redis is skipped for
``retry_after_s`` so requests do not each pay a timeout.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import Final

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

from routing.background import Flag, sleep_unless, stop_tasks
from routing.contract import ClientKeySpec, RedisKeys

logger = logging.getLogger("routing.ratelimit")

_WINDOW_MS: Final = 60_000  # limits are per minute

# Both bucket scripts start here: Redis's clock (gateways' clocks may be skewed), ARGV[1] and ARGV[2]
# the key's requests/min and tokens/min (0: unlimited), and each bucket refilled to now (``r``,
# ``t``; a missing bucket is full).
_LEVELS = """
local now_parts = redis.call('TIME')
local now = tonumber(now_parts[1]) * 1000 + math.floor(tonumber(now_parts[2]) / 1000)
local rpm = tonumber(ARGV[1])
local tpm = tonumber(ARGV[2])
local state = redis.call('HMGET', KEYS[1], 'r', 'rt', 't', 'tt')
local function level(limit, value, at)
  if limit <= 0 then return 0 end
  if not value then return limit end
  return math.min(limit, tonumber(value) + (now - tonumber(at)) * limit / 60000)
end
local r = level(rpm, state[1], state[2])
local t = level(tpm, state[3], state[4])
"""

# KEYS[1]: the key's bucket hash. ARGV: requests/min, tokens/min (0: unlimited), tokens to charge,
# extra requests and extra tokens to lease for the gateway's next requests (only what is there).
# Returns {allowed, reason (0 none, 1 requests, 2 tokens), requests left, ms to full, tokens left,
# ms to full, ms until the request could pass, extra requests leased, extra tokens leased}.
_CHECK = (
    _LEVELS
    + """
local cost = tonumber(ARGV[3])
if tpm > 0 and cost > tpm then cost = tpm end
local reason = 0
local wait = 0
if rpm > 0 and r < 1 then
  reason = 1
  wait = (1 - r) * 60000 / rpm
end
if tpm > 0 and t < cost then
  local token_wait = (cost - t) * 60000 / tpm
  if reason == 0 or token_wait > wait then reason = 2 end
  if token_wait > wait then wait = token_wait end
end
local extra_r = 0
local extra_t = 0
if reason == 0 then
  if rpm > 0 then
    r = r - 1
    extra_r = math.max(0, math.min(tonumber(ARGV[4]), math.floor(r)))
    r = r - extra_r
  end
  if tpm > 0 then
    t = t - cost
    extra_t = math.max(0, math.min(tonumber(ARGV[5]), math.floor(t)))
    t = t - extra_t
  end
  redis.call('HSET', KEYS[1], 'r', tostring(r), 'rt', now, 't', tostring(t), 'tt', now)
  redis.call('PEXPIRE', KEYS[1], 120000)
end
local r_reset = 0
local t_reset = 0
if rpm > 0 then r_reset = (rpm - r) * 60000 / rpm end
if tpm > 0 then t_reset = (tpm - t) * 60000 / tpm end
return {reason == 0 and 1 or 0, reason, math.floor(r), math.ceil(r_reset), math.floor(t), math.ceil(t_reset), math.ceil(wait), extra_r, extra_t}
"""
)

# KEYS[1]: the bucket hash. ARGV: tokens/min, tokens to give back (negative: to take).
_SETTLE = """
local tpm = tonumber(ARGV[1])
local state = redis.call('HMGET', KEYS[1], 't', 'tt')
if not state[1] then return 0 end
local t = math.max(-tpm, math.min(tpm, tonumber(state[1]) + tonumber(ARGV[2])))
redis.call('HSET', KEYS[1], 't', tostring(t))
return 1
"""

# KEYS[1]: the bucket hash. ARGV: requests/min, tokens/min, requests and tokens to take: what a
# gateway admitted on its own counts while Redis was unreachable, charged once it answers again.
# A bucket goes no lower than a minute's debt; a missing (expired) one starts full.
_CHARGE = (
    _LEVELS
    + """
r = math.max(-rpm, r - tonumber(ARGV[3]))
t = math.max(-tpm, t - tonumber(ARGV[4]))
redis.call('HSET', KEYS[1], 'r', tostring(r), 'rt', now, 't', tostring(t), 'tt', now)
redis.call('PEXPIRE', KEYS[1], 120000)
return 1
"""
)

REQUESTS: Final = "requests"
TOKENS: Final = "tokens"


class Verdict:
    """The answer for one request; ``headers`` are OpenAI's ``x-ratelimit-*``."""

    __slots__ = ("allowed", "headers", "reason", "retry_after_s")

    def __init__(
        self, allowed: bool, reason: str | None, retry_after_s: float, headers: list[tuple[bytes, bytes]]
    ) -> None:
        self.allowed = allowed
        self.reason = reason  # requests | tokens, when refused
        self.retry_after_s = retry_after_s
        self.headers = headers


def _reset_text(ms: float) -> bytes:
    """OpenAI writes resets like ``1s`` or ``6m0s``; seconds with a fraction read the same way."""
    return f"{ms / 1000:.3g}s".encode() if ms >= 1 else b"0s"


def _remaining(limit: int, left: float) -> bytes:
    return str(min(limit, max(0, int(left)))).encode()


def header_lines(headers: list[tuple[bytes, bytes]]) -> bytes:
    """``x-ratelimit-*`` headers as an answer head's fields, ``b"\\r\\nname: value"`` each (the
    client side's ``respond(own=...)``; the names are lower-case already)."""
    return b"".join([b"\r\n" + name + b": " + value for name, value in headers])


def make_verdict(key: ClientKeySpec, raw: list[int] | tuple[float, ...]) -> Verdict:
    allowed, reason, requests_left, requests_reset_ms, tokens_left, tokens_reset_ms, wait_ms = raw[:7]
    headers: list[tuple[bytes, bytes]] = []
    if key.requests_per_min:
        headers += [
            (b"x-ratelimit-limit-requests", str(key.requests_per_min).encode()),
            (b"x-ratelimit-remaining-requests", _remaining(key.requests_per_min, requests_left)),
            (b"x-ratelimit-reset-requests", _reset_text(requests_reset_ms)),
        ]
    if key.tokens_per_min:
        headers += [
            (b"x-ratelimit-limit-tokens", str(key.tokens_per_min).encode()),
            (b"x-ratelimit-remaining-tokens", _remaining(key.tokens_per_min, tokens_left)),
            (b"x-ratelimit-reset-tokens", _reset_text(tokens_reset_ms)),
        ]
    return Verdict(
        bool(allowed),
        None if allowed else (REQUESTS if reason == 1 else TOKENS),
        wait_ms / 1000,
        headers,
    )


class LocalBuckets:
    """The same buckets in this process's memory: the fallback while Redis is unreachable."""

    def __init__(self) -> None:
        self._state: dict[str, list[float]] = {}  # key id -> [requests, at_ms, tokens, at_ms]

    def check(self, key: ClientKeySpec, cost: int, now_ms: float) -> tuple[float, ...]:
        rpm = key.requests_per_min or 0
        tpm = key.tokens_per_min or 0
        state = self._state.get(key.id)
        if state is None:
            state = self._state[key.id] = [rpm, now_ms, tpm, now_ms]
        r = min(rpm, state[0] + (now_ms - state[1]) * rpm / _WINDOW_MS) if rpm else 0.0
        t = min(tpm, state[2] + (now_ms - state[3]) * tpm / _WINDOW_MS) if tpm else 0.0
        cost = min(cost, tpm) if tpm else cost
        reason, wait = 0, 0.0
        if rpm and r < 1:
            reason, wait = 1, (1 - r) * _WINDOW_MS / rpm
        if tpm and t < cost:
            token_wait = (cost - t) * _WINDOW_MS / tpm
            if reason == 0 or token_wait > wait:
                reason = 2
            wait = max(wait, token_wait)
        if reason == 0:
            r -= 1 if rpm else 0
            t -= cost if tpm else 0
            state[:] = [r, now_ms, t, now_ms]
        r_reset = (rpm - r) * _WINDOW_MS / rpm if rpm else 0
        t_reset = (tpm - t) * _WINDOW_MS / tpm if tpm else 0
        return (1 if reason == 0 else 0, reason, math.floor(r), r_reset, math.floor(t), t_reset, wait)

    def sync(self, key: ClientKeySpec, requests_left: float, tokens_left: float, now_ms: float) -> None:
        """What the shared buckets held at the script's last answer: a fallback starts from there,
        not full. (It started full: one call that timed out mid-minute let this gateway admit a
        second minute's allowance, past the N-gateways-times-the-limit bound.)"""
        self._state[key.id] = [float(requests_left), now_ms, float(tokens_left), now_ms]

    def settle(self, key_id: str, tpm: int, give_back: int) -> None:
        state = self._state.get(key_id)
        if state is not None:
            state[2] = max(-tpm, min(tpm, state[2] + give_back))


def make_limiter_redis(url: str, timeout_s: float) -> Redis:
    """A client of its own with short timeouts: a slow Redis must cost a request little, and a
    timed-out connection must not disturb the policy store's client."""
    return Redis.from_url(
        url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
    )


async def warm(redis: Redis, *scripts: AsyncScript) -> None:
    """Open a connection and load ``scripts`` before a request needs them (a background task at
    start). With Redis a WAN round trip away a cold first call paid one more round trip to connect
    (and two more for a script Redis did not hold): the routing benchmark's far gateways spent
    three round trips on their first request (``--shared-state wan --front-door``)."""
    try:
        pipe = redis.pipeline(transaction=False)  # one round trip for all of them
        for script in scripts:
            pipe.script_load(script.script)
        await pipe.execute()
    except (RedisError, OSError, TimeoutError) as exc:
        logger.debug("limits: could not warm the Redis connection (%s); the first call will", exc)


class RedisBackoff:
    """After a failed Redis call, answer locally for ``retry_after_s`` so requests do not each pay
    a timeout; warn once per outage. Used by the rate and the concurrency limiters.

    An outage lasts from the first failed call to the next call that succeeds. (Before issue 22
    every retry after ``retry_after_s`` that failed again warned again: a hung Redis, whose calls
    each time out, logged the warning every 1.25 s.)
    """

    __slots__ = ("_retry_after_s", "_what", "down", "until")

    def __init__(self, retry_after_s: float, what: str) -> None:
        self._retry_after_s = retry_after_s
        self._what = what
        self.until = 0.0  # monotonic: local answers only until then
        self.down = False  # a call failed and none has succeeded since

    def up(self, now: float) -> bool:
        return now >= self.until

    def failed(self, now: float, exc: BaseException) -> None:
        if not self.down:
            self.down = True
            logger.warning("%s: Redis unreachable (%s); per-gateway limits meanwhile", self._what, exc)
        self.until = now + self._retry_after_s

    def succeeded(self) -> None:
        if self.down:
            self.down = False
            logger.info("%s: Redis answers again; shared limits again", self._what)


class _Lease:
    """Allowance a gateway took from a key's shared buckets ahead of its next requests.

    Its requests are answered from memory. Their ``x-ratelimit-*`` headers are those of the
    script's last answer (limits and resets as the shared buckets stood then); only the two
    remaining counts change per request, so the rest is built once per lease, not per request.
    """

    __slots__ = ("_pieces", "limits", "requests", "shared_requests", "shared_tokens", "template", "tokens")

    def __init__(self, key: ClientKeySpec, requests: float, tokens: float, raw: list[int]) -> None:
        self.limits = (key.requests_per_min or 0, key.tokens_per_min or 0)
        self.requests = requests
        self.tokens = tokens
        # What the shared buckets held at the script's answer; remaining = that + this lease.
        self.shared_requests = raw[2]
        self.shared_tokens = raw[4]
        self.template = make_verdict(key, raw).headers
        # ``head``'s bytes around the two remaining counts: [before requests', before tokens',
        # after] with both limits, [before the one count, after] with one.
        lines = [b"\r\n" + name + b": " + value for name, value in self.template]
        rpm, tpm = self.limits
        self._pieces: tuple[bytes, ...] = ()
        if rpm and tpm:
            self._pieces = (
                lines[0] + b"\r\nx-ratelimit-remaining-requests: ",
                lines[2] + lines[3] + b"\r\nx-ratelimit-remaining-tokens: ",
                lines[5],
            )
        elif rpm or tpm:
            remaining = b"requests" if rpm else b"tokens"
            self._pieces = (lines[0] + b"\r\nx-ratelimit-remaining-" + remaining + b": ", lines[2])

    def headers(self, cost_tokens: int) -> list[tuple[bytes, bytes]]:
        """The headers of a request just charged ``cost_tokens`` (and one request) to this lease.

        Remaining = the shared buckets as of the script's answer + what this lease still holds.
        The bucket refills while the lease is held, so that sum can pass the limit; a client is
        never told more than the limit minus what its request just used.
        """
        rpm, tpm = self.limits
        headers = self.template.copy()
        if rpm:
            headers[1] = (
                b"x-ratelimit-remaining-requests",
                _remaining(rpm - 1, self.shared_requests + self.requests),
            )
        if tpm:
            headers[4 if rpm else 1] = (
                b"x-ratelimit-remaining-tokens",
                _remaining(tpm - cost_tokens, self.shared_tokens + self.tokens),
            )
        return headers

    def head(self, cost_tokens: int) -> bytes:
        """``headers(cost_tokens)`` as the answer's head bytes (``header_lines`` of them), from the
        lease's prebuilt pieces: the answer's per-field work is for the two counts only."""
        rpm, tpm = self.limits
        pieces = self._pieces
        if rpm and tpm:
            return (
                pieces[0]
                + _remaining(rpm - 1, self.shared_requests + self.requests)
                + pieces[1]
                + _remaining(tpm - cost_tokens, self.shared_tokens + self.tokens)
                + pieces[2]
            )
        if rpm:
            return pieces[0] + _remaining(rpm - 1, self.shared_requests + self.requests) + pieces[1]
        if tpm:
            return pieces[0] + _remaining(tpm - cost_tokens, self.shared_tokens + self.tokens) + pieces[1]
        return b""


class RateLimiter:
    """Checks and charges a key's shared buckets; settles token charges in the background."""

    def __init__(
        self,
        redis: Redis,
        keys: RedisKeys,
        *,
        retry_after_s: float = 1.0,
        settle_interval_s: float = 0.5,
        lease_fraction: float = 0.01,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._redis = redis
        self._clock = clock  # seconds, only for the Redis backoff and the local buckets
        self._keys = keys
        self.backoff = RedisBackoff(retry_after_s, "rate limits")
        self._settle_interval_s = settle_interval_s
        self._lease_fraction = lease_fraction
        self._leases: dict[str, _Lease] = {}
        # key id -> the script call in flight for it (its result: a refusal and its token cost, or
        # None), and what the requests waiting for that call need: [requests, tokens].
        self._calls: dict[str, asyncio.Future[tuple[Verdict, int] | None]] = {}
        self._waiting: dict[str, list[int]] = {}
        self._check = redis.register_script(_CHECK)
        self._settle = redis.register_script(_SETTLE)
        self._charge = redis.register_script(_CHARGE)
        self.local = LocalBuckets()
        self._pending: dict[tuple[str, int], int] = {}  # (key id, tpm) -> tokens to give back
        # (key id, rpm, tpm) -> [requests, tokens] admitted on the local counts while Redis was
        # unreachable, charged to the shared buckets once it answers (``_flush``)
        self._owed: dict[tuple[str, int, int], list[int]] = {}
        self._closing = Flag()
        self._task: asyncio.Task[None] | None = None
        self._warming: asyncio.Task[None] | None = None
        self._refills: set[asyncio.Task[None]] = set()  # background lease refills in flight
        self.fallbacks = 0  # checks answered locally because Redis was unreachable

    def from_lease(self, key: ClientKeySpec, cost_tokens: int) -> list[tuple[bytes, bytes]] | None:
        """Charge the request to this gateway's lease when it covers it (no I/O) and return its
        ``x-ratelimit-*`` headers; ``None`` when ``check`` must ask Redis."""
        lease = self._charge_lease(key, cost_tokens)
        return lease.headers(cost_tokens) if lease is not None else None

    def head_from_lease(self, key: ClientKeySpec, cost_tokens: int) -> bytes | None:
        """``from_lease``, its headers as the answer's head bytes (``header_lines`` of them)."""
        lease = self._charge_lease(key, cost_tokens)
        return lease.head(cost_tokens) if lease is not None else None

    def _charge_lease(self, key: ClientKeySpec, cost_tokens: int) -> _Lease | None:
        lease = self._leases.get(key.id)
        if lease is None:
            return None
        rpm, tpm = lease.limits
        if (
            rpm != (key.requests_per_min or 0)
            or tpm != (key.tokens_per_min or 0)
            or (rpm and lease.requests < 1)
            or (tpm and lease.tokens < cost_tokens)
        ):
            return None
        if rpm:
            lease.requests -= 1
        if tpm:
            lease.tokens -= cost_tokens
        if self._low(lease):
            self._refill_soon(key)
        return lease

    def prefetch(self, key: ClientKeySpec) -> None:
        """Start taking ``key``'s first lease here in the background when there is none yet: the
        front door calls it before it waits for a concurrency slot, so a key's first request at a
        gateway waits one round trip for both instead of one after the other."""
        if key.id not in self._leases and (key.requests_per_min or key.tokens_per_min):
            self._refill_soon(key)

    def _low(self, lease: _Lease) -> bool:
        """Half of a lease's slice is spent: time to refill it before a request finds it empty."""
        rpm, tpm = lease.limits
        slice_requests = int(rpm * self._lease_fraction)
        slice_tokens = int(tpm * self._lease_fraction)
        return bool(
            (slice_requests and lease.requests <= slice_requests / 2)
            or (slice_tokens and lease.tokens <= slice_tokens / 2)
        )

    def _refill_soon(self, key: ClientKeySpec) -> None:
        """Top the lease up in the background (issue 24): with Redis a WAN round trip away, the
        request that found the lease empty waited that round trip. The refill is the key's one call
        in flight, so requests that do run out meanwhile wait for it as for any call."""
        if key.id in self._calls or not self.backoff.up(self._clock()):
            return
        call: asyncio.Future[tuple[Verdict, int] | None] = asyncio.get_running_loop().create_future()
        self._calls[key.id] = call
        task = asyncio.create_task(self._refill(key, call), name="gorgo-ratelimit-refill")
        self._refills.add(task)
        task.add_done_callback(self._refills.discard)

    async def _refill(self, key: ClientKeySpec, call: asyncio.Future[tuple[Verdict, int] | None]) -> None:
        rpm = key.requests_per_min or 0
        tpm = key.tokens_per_min or 0
        now = self._clock()
        try:
            extra_requests, extra_tokens = self._extras(key.id, rpm, tpm)
            extra_requests = max(0, extra_requests - 1)  # the request the call charges joins the lease
            try:
                # Charges one request and no tokens: that request goes into the lease too.
                raw = await self._check(
                    keys=[self._keys.rate_limit(key.id)], args=[rpm, tpm, 0, extra_requests, extra_tokens]
                )
            except (RedisError, OSError, TimeoutError) as exc:
                self.backoff.failed(now, exc)
                return
            self.backoff.succeeded()
            self.local.sync(key, raw[2], raw[4], self._clock() * 1000)
            if not raw[0]:
                return  # the buckets are empty: the next request that needs them asks (and is refused)
            lease = self._leases.get(key.id)
            leftover = lease if lease is not None and lease.limits == (rpm, tpm) else None
            self._leases[key.id] = _Lease(
                key,
                raw[7] + (1 if rpm else 0) + (leftover.requests if leftover else 0),
                raw[8] + (leftover.tokens if leftover else 0),
                list(raw),
            )
        finally:
            del self._calls[key.id]
            call.set_result(None)

    async def check(self, key: ClientKeySpec, cost_tokens: int) -> Verdict:
        """Charge one request and ``cost_tokens`` to ``key`` if both buckets allow it.

        From this gateway's lease when it covers the request (no Redis call), else one script call
        that charges the request and takes the next lease: ``lease_fraction`` of the key's limits
        per minute, or whatever is left. Leased allowance was taken from the shared buckets, so
        leasing never lets the fleet admit more than the limits; it only lets one gateway hold
        (at most ``lease_fraction`` of a minute's) allowance the others then cannot use.

        One script call per key is in flight at a time (issue 22, item 4): requests that miss the
        lease while a call is out wait for it, and the next call leases enough for all of them.
        Before, every concurrent miss made its own call, each took a lease and only the last one
        was kept: 200 concurrent requests to a fresh 120/min key admitted 61.
        """
        while True:
            headers = self.from_lease(key, cost_tokens)
            if headers is not None:
                return Verdict(True, None, 0.0, headers)
            now = self._clock()
            if not self.backoff.up(now):
                return self._check_locally(key, cost_tokens, now)
            call = self._calls.get(key.id)
            if call is None:
                return await self._call(key, cost_tokens, now)
            waiting = self._waiting.setdefault(key.id, [0, 0])
            waiting[0] += 1
            waiting[1] += cost_tokens
            try:
                # shield: a waiter whose client left must not cancel the call the others wait for.
                refusal = await asyncio.shield(call)
            finally:
                waiting[0] -= 1
                waiting[1] -= cost_tokens
                if waiting[0] <= 0:
                    self._waiting.pop(key.id, None)
            # The shared buckets just refused a request: refuse this one too without asking again
            # when it needs at least what was missing (a request, or as many tokens).
            if refusal is not None and (refusal[0].reason == REQUESTS or cost_tokens >= refusal[1]):
                return refusal[0]

    def _check_locally(self, key: ClientKeySpec, cost_tokens: int, now: float) -> Verdict:
        """The fallback while Redis is unreachable: this gateway's own counts. What they admit is
        owed to the shared buckets and charged once Redis answers (``_flush``); before, the fleet
        could admit a limit's worth on top of the outage's admissions in the minute after it."""
        self.fallbacks += 1
        raw = self.local.check(key, cost_tokens, now * 1000)
        if raw[0]:
            rpm, tpm = key.requests_per_min or 0, key.tokens_per_min or 0
            owed = self._owed.setdefault((key.id, rpm, tpm), [0, 0])
            owed[0] += 1 if rpm else 0
            owed[1] += min(cost_tokens, tpm) if tpm else 0
        return make_verdict(key, raw)

    def _extras(self, key_id: str, rpm: int, tpm: int) -> tuple[int, int]:
        """What the next script call leases beyond its own request: the lease topped up to its size,
        never past it (a lease whose tokens ran out while it still held requests would otherwise
        hoard more requests on every refill), plus what the requests already waiting for the call
        need (they take it out again at once)."""
        lease = self._leases.get(key_id)
        leftover = lease if lease is not None and lease.limits == (rpm, tpm) else None
        waiting_requests, waiting_tokens = self._waiting.get(key_id, (0, 0))
        extra_requests = waiting_requests + max(
            0, int(rpm * self._lease_fraction) - int(leftover.requests if leftover else 0)
        )
        extra_tokens = waiting_tokens + max(
            0, int(tpm * self._lease_fraction) - int(leftover.tokens if leftover else 0)
        )
        return extra_requests, extra_tokens

    async def _call(self, key: ClientKeySpec, cost_tokens: int, now: float) -> Verdict:
        """The one script call for ``key``: charges this request and leases for the waiters too."""
        rpm = key.requests_per_min or 0
        tpm = key.tokens_per_min or 0
        call: asyncio.Future[tuple[Verdict, int] | None] = asyncio.get_running_loop().create_future()
        self._calls[key.id] = call
        refusal: tuple[Verdict, int] | None = None
        try:
            extra_requests, extra_tokens = self._extras(key.id, rpm, tpm)
            try:
                # The client's own socket timeouts bound this (see make_limiter_redis).
                raw = await self._check(
                    keys=[self._keys.rate_limit(key.id)],
                    args=[rpm, tpm, cost_tokens, extra_requests, extra_tokens],
                )
            except (RedisError, OSError, TimeoutError) as exc:
                self.backoff.failed(now, exc)
                return self._check_locally(key, cost_tokens, now)
            self.backoff.succeeded()
            self.local.sync(key, raw[2], raw[4], self._clock() * 1000)
            if not raw[0]:
                verdict = make_verdict(key, raw)
                refusal = (verdict, cost_tokens)
                return verdict
            # Add to what the lease holds now, not to what it held before the call: nothing else
            # changed it meanwhile (this was the only call), and nothing leased is ever dropped.
            lease = self._leases.get(key.id)
            leftover = lease if lease is not None and lease.limits == (rpm, tpm) else None
            lease = self._leases[key.id] = _Lease(
                key,
                raw[7] + (leftover.requests if leftover else 0),
                raw[8] + (leftover.tokens if leftover else 0),
                list(raw),
            )
            # Remaining: the shared buckets plus this gateway's lease (the key may still use it).
            return Verdict(True, None, 0.0, lease.headers(cost_tokens))
        finally:
            del self._calls[key.id]
            call.set_result(refusal)

    def settle(self, key: ClientKeySpec, charged_tokens: int, used_tokens: int) -> None:
        """The node reported ``used_tokens``; correct the up-front charge (batched, never awaited).

        A request that used more than it was charged (a long answer) pays the difference out of
        this gateway's lease first, and sends Redis only what the lease cannot cover: the lease was
        taken from the same minute, and if the debt went to Redis alone the lease would go on
        admitting as if it had not been spent (a key at 100k tokens/min let through ~116k with
        1,000-token answers)."""
        if not key.tokens_per_min or used_tokens == charged_tokens:
            return
        give_back = charged_tokens - used_tokens
        if give_back < 0:
            lease = self._leases.get(key.id)
            if lease is not None and lease.limits[1] == key.tokens_per_min and lease.tokens >= 1:
                paid = min(int(lease.tokens), -give_back)
                lease.tokens -= paid
                give_back += paid
                if give_back == 0:
                    return
        self.local.settle(key.id, key.tokens_per_min, give_back)
        slot = (key.id, key.tokens_per_min)
        self._pending[slot] = self._pending.get(slot, 0) + give_back

    def start(self) -> None:
        self._task = asyncio.create_task(self._settle_loop(), name="gorgo-ratelimit-settle")
        self._warming = asyncio.create_task(
            warm(self._redis, self._check, self._settle, self._charge), name="gorgo-ratelimit-warm"
        )

    async def close(self) -> None:
        self._closing.set()
        if self._warming is not None:
            await stop_tasks([self._warming], grace_s=1.0)
        if self._task is not None:
            await stop_tasks([self._task], grace_s=self._settle_interval_s + 1.0)
        if self._refills:
            await stop_tasks(list(self._refills), grace_s=1.0)
        await self._flush()

    async def _settle_loop(self) -> None:
        while not await sleep_unless(self._closing, self._settle_interval_s):
            await self._flush()

    async def _flush(self) -> None:
        """Send the token corrections and what was admitted during an outage, in one round trip.
        While Redis is still skipped, or when the call fails, both are kept for the next flush
        (bounded: one entry per key), so an outage's admissions are charged once it ends."""
        if not (self._pending or self._owed) or not self.backoff.up(self._clock()):
            return
        pending, self._pending = self._pending, {}
        owed, self._owed = self._owed, {}
        try:
            async with asyncio.timeout(1.0):
                async with self._redis.pipeline(transaction=False) as pipe:
                    for (key_id, rpm, tpm), (requests, tokens) in owed.items():
                        await self._charge(
                            keys=[self._keys.rate_limit(key_id)],
                            args=[rpm, tpm, requests, tokens],
                            client=pipe,
                        )
                    for (key_id, tpm), give_back in pending.items():
                        await self._settle(
                            keys=[self._keys.rate_limit(key_id)], args=[tpm, give_back], client=pipe
                        )
                    await pipe.execute()
        except (RedisError, OSError, TimeoutError) as exc:
            logger.debug(
                "rate limits: settling failed (%s); keeping %d entries", exc, len(pending) + len(owed)
            )
            self.backoff.failed(self._clock(), exc)
            for slot, give_back in pending.items():
                self._pending[slot] = self._pending.get(slot, 0) + give_back
            for owed_slot, (requests, tokens) in owed.items():
                entry = self._owed.setdefault(owed_slot, [0, 0])
                entry[0] += requests
                entry[1] += tokens
