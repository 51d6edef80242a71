"""The gateway's view of Redis: the policy snapshot and the live state, kept current in the background.

- At start: GET the current snapshot and the live state (bounded in time; the gateway starts even
  when Redis is down and reports unhealthy until a policy arrives).
- Then one task listens on the policy and live channels. An announcement triggers a GET of the
  snapshot and an atomic swap of the routing table (well under a second end to end). A snapshot
  that does not decode, has an unknown schema version or names an unknown algorithm is refused
  with a logged error and the old table is kept.
- A second task re-reads the live state every ``live_refresh_interval_s`` (announcements on the
  live channel just make it sooner). A node's live entry older than ``live_stale_s`` (by its
  ``updated_at``) is dropped, so the node counts as unmeasured: when the telemetry workers stop,
  an "unhealthy" mark must not exclude a node forever, nor a stale "healthy" keep it in. Ages are
  computed here, at each refresh (also when Redis is unreachable), never on the request path, and
  count from when this gateway first read an entry's stamp when that is longer
  (``routing.state.ages``: a worker whose clock runs ahead stamps entries in our future). An entry
  whose probes go on while its scrape stopped (``last_scrape_at`` older than ``live_stale_s``)
  keeps its health and loses its load figures: unknown, not as they were.
- Redis errors never reach requests: the last good table stays in use, and the listener
  reconnects with exponential backoff, re-reading everything on reconnect (announcements sent
  while it was away are lost by pub/sub).

No request ever waits on Redis: requests read ``PolicyStore.table``, a plain attribute.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

import msgspec
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from routing.algorithms.base import AlgorithmInfo
from routing.background import Flag, run_bounded, sleep_unless, stop_tasks
from routing.contract import (
    NodeLiveState,
    PolicyAnnouncement,
    PolicySnapshot,
    RedisKeys,
    RTTTable,
    UnknownSchemaVersion,
    decode,
)
from routing.state.ages import EntryAges
from routing.state.eligibility import rtt_from_region
from routing.state.table import RoutingTable, UnknownAlgorithm, build_table

logger = logging.getLogger("routing.policy")

_MIN_BACKOFF_S = 0.1
_MAX_BACKOFF_S = 5.0
_PUBSUB_POLL_S = 0.25  # also how long a shutdown may wait for the listener
_STARTUP_TIMEOUT_S = 2.0
# The most sequences (running or waiting) a scrape may say one engine holds. The scrape drops only
# NaN and infinities, so a broken or hostile /metrics page could say 1e308: gorgo's queue term then
# overflowed to inf, its displacement took 0 * inf = NaN, and no candidate's cost compared (every
# decision over the model failed). Past this, or below 0, the figure is unknown, as a failed scrape's.
MAX_SCRAPED_SEQUENCES = 1_000_000.0


def _plausible(state: NodeLiveState) -> NodeLiveState:
    """``state`` without a sequence count no engine has (``MAX_SCRAPED_SEQUENCES``); its health and
    its other figures as they are."""
    running, waiting = state.num_running, state.num_waiting
    if (running is None or 0.0 <= running <= MAX_SCRAPED_SEQUENCES) and (
        waiting is None or 0.0 <= waiting <= MAX_SCRAPED_SEQUENCES
    ):
        return state
    return msgspec.structs.replace(
        state,
        num_running=running if running is not None and 0.0 <= running <= MAX_SCRAPED_SEQUENCES else None,
        num_waiting=waiting if waiting is not None and 0.0 <= waiting <= MAX_SCRAPED_SEQUENCES else None,
    )


def _unscraped(state: NodeLiveState) -> NodeLiveState:
    """``state`` with what its scrape measured left out (unknown), its health kept."""
    measured = (state.num_running, state.num_waiting, state.kv_cache_usage, state.prefix_hit_rate)
    if all(figure is None for figure in measured):
        return state
    return msgspec.structs.replace(
        state, num_running=None, num_waiting=None, kv_cache_usage=None, prefix_hit_rate=None
    )


def make_redis(url: str) -> Redis:
    """A Redis client that fails fast: our loops own retrying, so redis-py must not sleep in calls."""
    return Redis.from_url(
        url,
        socket_connect_timeout=1.0,
        socket_timeout=2.0,
        health_check_interval=10,
        retry=Retry(NoBackoff(), 0),
    )


class PolicyStore:
    """Holds the current ``RoutingTable`` and keeps it in step with Redis."""

    def __init__(
        self,
        redis: Redis,
        keys: RedisKeys,
        region: str,
        registry: Mapping[str, AlgorithmInfo],
        *,
        live_refresh_interval_s: float = 1.0,
        live_stale_s: float = 30.0,
        on_snapshot: Callable[[RoutingTable], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._region = region
        self._registry = registry
        self._live_refresh_interval_s = live_refresh_interval_s
        self._live_stale_s = live_stale_s
        self._clock = clock  # unix seconds, to compare with the entries' updated_at
        self._on_snapshot = on_snapshot  # called after each swap to a new snapshot (not live changes)
        self.table: RoutingTable | None = None
        # Redis counts as connected while the listener is subscribed AND the last periodic live
        # refresh answered. The refresh is the ping: a SIGSTOPped Redis keeps the pubsub socket open
        # and silent, which looks like "no announcements", so the listener alone never noticed
        # (issue 22, item 6: /healthz said redis_connected: true for a hung Redis).
        self._subscribed = False
        self._answering = True
        self.events: dict[str, int] = {}  # "swapped", "refused_<reason>": counts, for metrics
        self._snapshot: PolicySnapshot | None = None
        self._live: dict[int, NodeLiveState] = {}  # the fresh entries: what routing sees
        self._live_read: dict[int, NodeLiveState] = {}  # every entry of the last successful read
        self._live_ages = EntryAges()
        self._stale: frozenset[int] = frozenset()  # nodes whose entry is too old (logged once)
        self._rtt_ms: dict[int, float] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = Flag()

    # ---- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Load what Redis has (bounded in time), then keep it current in the background."""
        try:
            async with asyncio.timeout(_STARTUP_TIMEOUT_S):
                await self.refresh_live()
                await self.reload_policy()
            # Redis just answered: say so now, not only once the listener has subscribed (a health
            # check right after start would otherwise report a reachable Redis as down).
            self._subscribed = True
        except (TimeoutError, RedisError, OSError) as exc:
            logger.error("policy: Redis unreachable at start (%s); will keep trying", exc)
        self._tasks = [
            asyncio.create_task(self._listen(), name="gorgo-policy-listen"),
            asyncio.create_task(self._refresh_live_periodically(), name="gorgo-live-refresh"),
        ]

    async def close(self) -> None:
        self._closing.set()
        tasks, self._tasks = self._tasks, []
        await stop_tasks(tasks, grace_s=_PUBSUB_POLL_S + 1.0)

    @property
    def redis_connected(self) -> bool:
        return self._subscribed and self._answering

    def _set_answering(self, answering: bool, exc: BaseException | None = None) -> None:
        """The periodic live refresh's verdict on Redis; logged once per change, not per refresh."""
        if answering == self._answering:
            return
        self._answering = answering
        if answering:
            logger.info("policy: Redis answers again")
        else:
            logger.error("policy: Redis does not answer (%s); serving the last good policy", exc)

    # ---- loading ----------------------------------------------------------------------------

    async def reload_policy(self) -> bool:
        """GET the current snapshot and swap to it; ``False`` when refused or absent."""
        raw = await self._redis.get(self._keys.policy_current)
        if raw is None:
            if self._snapshot is None:
                logger.warning("policy: no snapshot at %s yet", self._keys.policy_current)
            return False
        try:
            snapshot = decode(raw, PolicySnapshot)
        except UnknownSchemaVersion as exc:
            return self._refuse("schema_version", f"{exc}")
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return self._refuse("invalid", f"snapshot does not decode: {exc}")
        current = self._snapshot
        if current is not None and (current.version, current.checksum) == (
            snapshot.version,
            snapshot.checksum,
        ):
            return True
        try:
            table = build_table(snapshot, self._region, self._registry, self._live, self._rtt_ms)
        except UnknownAlgorithm as exc:
            return self._refuse("algorithm", str(exc))
        self._snapshot, self.table = snapshot, table
        self._count("swapped")
        if self._on_snapshot is not None:
            self._on_snapshot(table)
        logger.info(
            "policy: now serving %r v%d (%s, %d nodes)",
            snapshot.policy.name,
            snapshot.version,
            snapshot.policy.algorithm,
            len(snapshot.nodes),
        )
        return True

    async def refresh_live(self) -> None:
        """Re-read node live state and the RTT table; rebuild the table only if they changed."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(self._keys.live_nodes)
            pipe.get(self._keys.live_rtt)
            raw_nodes, raw_rtt = await pipe.execute()
        live: dict[int, NodeLiveState] = {}
        for value in raw_nodes.values():
            try:
                state = decode(value, NodeLiveState)
            except (UnknownSchemaVersion, msgspec.ValidationError, msgspec.DecodeError) as exc:
                logger.warning("live state: skipping an entry that does not decode (%s)", exc)
                continue
            live[state.node_id] = _plausible(state)
        self._live_read = live
        self._live_ages.keep([*live, *((node_id, "scrape") for node_id in live)])
        rtt_ms = self._rtt_ms
        if raw_rtt is not None:
            try:
                rtt_ms = rtt_from_region(decode(raw_rtt, RTTTable), self._region)
            except (UnknownSchemaVersion, msgspec.ValidationError, msgspec.DecodeError) as exc:
                logger.warning("live state: keeping the old RTT table, the new one does not decode (%s)", exc)
        self._apply_live(rtt_ms)

    def expire_live(self) -> None:
        """Drop live entries that aged past ``live_stale_s`` since the last read (no Redis needed)."""
        self._apply_live(self._rtt_ms)

    def _apply_live(self, rtt_ms: dict[int, float]) -> None:
        now_s, stale_s, ages = self._clock(), self._live_stale_s, self._live_ages
        live: dict[int, NodeLiveState] = {}
        for node_id, state in self._live_read.items():
            if ages.age_s(node_id, state.updated_at, now_s) > stale_s:
                continue
            scraped_at = state.last_scrape_at
            if scraped_at is not None and ages.age_s((node_id, "scrape"), scraped_at, now_s) > stale_s:
                # Probes still refresh the entry, but its scrape stopped (the node's /metrics broke,
                # or the scrape task did): its load figures are that old, and read as current they
                # priced the node on a queue it no longer has. Unknown instead.
                state = _unscraped(state)
            live[node_id] = state
        stale = frozenset(self._live_read.keys() - live.keys())
        if stale - self._stale:
            logger.warning(
                "live state: entries of node(s) %s are older than %gs; treating them as unknown "
                "(are the telemetry workers running?)",
                ", ".join(map(str, sorted(stale - self._stale))),
                self._live_stale_s,
            )
        self._stale = stale
        if live == self._live and rtt_ms == self._rtt_ms:
            return
        self._live, self._rtt_ms = live, rtt_ms
        if self._snapshot is not None and self.table is not None:
            self.table = build_table(self._snapshot, self._region, self._registry, live, rtt_ms)

    def _refuse(self, reason: str, message: str) -> bool:
        self._count(f"refused_{reason}")
        kept = "no policy loaded yet" if self._snapshot is None else f"keeping v{self._snapshot.version}"
        logger.error("policy: refused a new snapshot: %s (%s)", message, kept)
        return False

    def _count(self, event: str) -> None:
        self.events[event] = self.events.get(event, 0) + 1

    # ---- background -------------------------------------------------------------------------

    async def _listen(self) -> None:
        backoff_s = _MIN_BACKOFF_S
        policy_channel = self._keys.policy_channel.encode()
        while not self._closing.is_set():
            pubsub = self._redis.pubsub()
            try:
                await pubsub.subscribe(self._keys.policy_channel, self._keys.live_channel)
                # Anything announced while we were not subscribed is lost; re-read it all.
                await self.refresh_live()
                await self.reload_policy()
                if not self._subscribed:
                    logger.info("policy: subscribed to %s", self._keys.policy_channel)
                self._subscribed = True
                self._set_answering(True)
                backoff_s = _MIN_BACKOFF_S
                while not self._closing.is_set():
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=_PUBSUB_POLL_S)
                    if message is None:
                        continue
                    if message["channel"] == policy_channel:
                        await self._on_announcement(message["data"])
                    else:
                        await self.refresh_live()
            except (RedisError, OSError) as exc:
                if self.redis_connected:
                    logger.error("policy: lost Redis (%s); serving the last good policy", exc)
                self._subscribed = False
                await sleep_unless(self._closing, backoff_s)
                backoff_s = min(backoff_s * 2, _MAX_BACKOFF_S)
            finally:
                # Bounded: closing a pubsub whose connection died can wait forever (redis-py#3941).
                await run_bounded(pubsub.aclose(), 1.0, "gorgo-pubsub-close")

    async def _on_announcement(self, data: bytes) -> None:
        try:
            announcement = decode(data, PolicyAnnouncement)
        except (UnknownSchemaVersion, msgspec.ValidationError, msgspec.DecodeError) as exc:
            # The snapshot itself decides; a malformed announcement is still a hint to look.
            logger.warning("policy: unreadable announcement (%s); re-reading the snapshot", exc)
        else:
            current = self._snapshot
            if current is not None and (current.version, current.checksum) == (
                announcement.version,
                announcement.checksum,
            ):
                return
        await self.reload_policy()

    async def _refresh_live_periodically(self) -> None:
        while not await sleep_unless(self._closing, self._live_refresh_interval_s):
            try:
                await self.refresh_live()
            except (RedisError, OSError) as exc:
                logger.debug("live state: refresh failed (%s); keeping the fresh part of the last one", exc)
                self._set_answering(False, exc)
                self.expire_live()
            else:
                self._set_answering(True)
