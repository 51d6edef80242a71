"""What gateways tell each other through Redis: prefix-index insertions and outstanding load.

A gateway runs one ``GatewaySharing`` with three background tasks; nothing here is ever awaited on
the request path:

- prefix publisher: every ``prefix_flush_interval_s`` it takes the index's new insertions, merges
  them per node and ``XADD``s one ``PrefixUpdate`` per node to ``RedisKeys.prefix_stream`` (field
  ``PREFIX_STREAM_FIELD``, approximate ``MAXLEN``).
- prefix reader: ``XREAD``s that stream (blocking for at most ``read_block_ms``, so updates arrive
  within milliseconds) and applies every other gateway's updates to the local index. Each entry
  also carries its writer's id in a field of its own (``PREFIX_STREAM_GATEWAY_FIELD``), so a
  gateway skips its own entries without decoding them. At start it replays the newest
  ``warm_start_entries`` entries younger than the index TTL, so a new gateway is not cold.
- load exchange: every ``load_interval_s`` one pipelined round trip writes this gateway's
  ``GatewayLoad`` into the ``RedisKeys.gateway_load`` hash and reads everyone's. Entries older
  than ``peer_stale_after_s`` are ignored (a gateway that died stops counting within seconds) and
  entries older than ``PRUNE_AFTER_S`` are deleted. The sum of the fresh peers' loads per node is
  published as an immutable ``peer_load`` mapping (and handed to ``on_peer_load``, e.g.
  ``InFlight.set_peer_load``), which the gateway adds to its own in-flight counts.
- claims (``PeerLoad``): a peer's prefix update is also a request it just sent to that node, up to
  two load periods before its load report says so. Until the report written after it has been
  read, each update counts in ``peer_load`` as one outstanding request whose prefill is the
  update's chunks this gateway's index did not yet place on that node. Without it a node a peer
  just sent a long prompt to looked warm (the index already had the prompt) and idle (its load
  not yet in) to every other gateway, which all sent their requests there: issue 24's herding on
  stale peer load (docs/routing.md). Claims ride the prefix stream, so they cost no Redis call.

Redis down: each task logs once, retries with exponential backoff and jitter, and the gateway
keeps routing on local data. Peer load older than ``peer_stale_after_s`` is dropped rather than
trusted forever; prefix insertions made while Redis is down are not shared (the index is an
estimate; the next insertions of a hot prefix will be).

Stopping: ``stop()`` sets a flag the loops check between commands; every wait is either a sleep
on that flag or an ``XREAD`` blocking ``read_block_ms`` at most, so the loops end by themselves
within one block. Tasks are never cancelled mid-command (redis-py can hang when cancelled in the
middle of one, see ``routing.background``); only a loop still stuck after the grace period is.

Timestamps are unix seconds (``time.time``), so gateways on different hosts need roughly synced
clocks (NTP); ``peer_stale_after_s`` tolerates a few hundred milliseconds of skew. A prefix update
stamped after this gateway's now enters its index as of now (``_not_after``), and reports and
claims also age from when they arrived here (``routing.state.ages``): a peer whose clock runs ahead
stops counting ``peer_stale_after_s`` after it stops, not after its skew runs out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Protocol

import msgspec
from redis.asyncio import Redis

from routing.algorithms.base import NodeLoad
from routing.background import Flag, sleep_unless, stop_tasks
from routing.contract import (
    PREFIX_STREAM_FIELD,
    PREFIX_STREAM_GATEWAY_FIELD,
    SCHEMA_VERSION,
    GatewayLoad,
    PrefixUpdate,
    RedisKeys,
    UnknownSchemaVersion,
    decode,
    encode,
)
from routing.state.ages import EntryAges

log = logging.getLogger("routing.sharing")  # the logger name operators filter on, kept across moves

PRUNE_AFTER_S = 60.0
_UPDATE_FIELD_BYTES = PREFIX_STREAM_FIELD.encode()
_GATEWAY_FIELD_BYTES = PREFIX_STREAM_GATEWAY_FIELD.encode()
MAX_HASHES_PER_UPDATE = 2048  # keeps one stream entry under ~50 KB of JSON
BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 5.0
# How often a gateway writes its load and reads its peers' (one round trip): a peer's load is up
# to twice this old when read (its last write, then our last read), plus the round trip to Redis.
# The event model (``simulator.replay``) ages peer load by the same period.
LOAD_INTERVAL_S = 0.1
# How often a gateway publishes its new prefix-index insertions (peers read them as they arrive).
PREFIX_FLUSH_INTERVAL_S = 0.05
# Claims waiting for their writer's next load report; past this the oldest are dropped (a peer
# whose reports stopped: its claims would otherwise count forever).
CLAIMS_MAX = 10_000
# Weight of each new sample in a peer's smoothed update delay (exponential moving average).
PEER_DELAY_SMOOTHING = 0.2

# (outstanding requests, outstanding prefill tokens, home requests, outstanding context tokens),
# each node id -> count
LoadSource = Callable[[], tuple[Mapping[int, int], Mapping[int, int], Mapping[int, int], Mapping[int, int]]]


class SharedIndex(Protocol):
    """What sharing needs of a prefix index (``ApproxPrefixIndex`` has it)."""

    ttl_s: float

    @property
    def chunk_tokens(self) -> float: ...

    def take_updates(self) -> list[tuple[int, tuple[int, ...], float]]: ...

    def apply_remote(self, update: PrefixUpdate) -> None: ...

    def match_hashes(
        self, hashes: Sequence[int], node_ids: Iterable[int], now_s: float
    ) -> dict[int, int]: ...


class GatewaySharing:
    """Background sharing of one gateway's prefix insertions and load with its peers."""

    def __init__(
        self,
        redis: Redis,
        keys: RedisKeys,
        *,
        gateway_id: str,
        region: str,
        index: SharedIndex,
        load_source: LoadSource,
        on_peer_load: Callable[[Mapping[int, NodeLoad]], None] | None = None,
        prefix_flush_interval_s: float = PREFIX_FLUSH_INTERVAL_S,
        load_interval_s: float = LOAD_INTERVAL_S,
        peer_stale_after_s: float = 3.0,
        stream_maxlen: int = 10_000,
        read_block_ms: int = 250,
        warm_start_entries: int = 2_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._redis = redis
        self._keys = keys
        self.gateway_id = gateway_id
        self.region = region
        self._index = index
        self._load_source = load_source
        self._on_peer_load = on_peer_load
        self.prefix_flush_interval_s = prefix_flush_interval_s
        self.load_interval_s = load_interval_s
        self.peer_stale_after_s = peer_stale_after_s
        self.stream_maxlen = stream_maxlen
        self.read_block_ms = read_block_ms
        self.warm_start_entries = warm_start_entries
        self._clock = clock
        self._peer_load: Mapping[int, NodeLoad] = MappingProxyType({})
        self._peers = PeerLoad()
        self._peer_load_at_s = 0.0
        self._report_ages = EntryAges()  # each peer's report: aged here too (``routing.state.ages``)
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = Flag()
        self._own_id = gateway_id.encode()
        self._failing: set[str] = set()
        # How stale each peer's state is here, for /metrics (peer gateway id -> seconds): how late
        # its prefix updates (and so its claims) arrive, smoothed, and how old its load report was
        # when last read. Over a WAN these are what a forward priced on them does not know yet.
        self.peer_update_delay_s: dict[str, float] = {}
        self.peer_report_age_s: dict[str, float] = {}
        # Counters for /metrics and tests.
        self.updates_sent = 0
        self.updates_applied = 0
        self.updates_rejected = 0
        self.own_updates_skipped = 0
        self.redis_errors = 0

    @property
    def peer_load(self) -> Mapping[int, NodeLoad]:
        """Node id -> the other gateways' outstanding work there (immutable; replaced, never mutated)."""
        return self._peer_load

    @property
    def connected(self) -> bool:
        """False while any task is failing to reach Redis."""
        return not self._failing

    # ---- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the background tasks (returns at once; Redis may be down)."""
        if self._tasks:
            return
        self._stopping.clear()
        self._tasks = [
            asyncio.create_task(
                self._forever("prefix-publish", self._publish_prefixes_once), name="gorgo-prefix-publish"
            ),
            asyncio.create_task(self._read_prefixes(), name="gorgo-prefix-read"),
            asyncio.create_task(
                self._forever("load-exchange", self._exchange_load_once), name="gorgo-load-exchange"
            ),
        ]

    async def stop(self) -> None:
        """Stop the tasks and withdraw this gateway's load entry (best effort, bounded).

        The loops see the flag at their next wait, at most one ``XREAD`` block (or one Redis
        command timeout) away; only one still running after that grace period is cancelled.
        """
        tasks, self._tasks = self._tasks, []
        self._stopping.set()
        await stop_tasks(tasks, grace_s=self.read_block_ms / 1000.0 + 1.0, timeout_s=1.0)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._redis.hdel(self._keys.gateway_load, self.gateway_id), 0.5)

    async def _forever(self, name: str, once: Callable[[], Awaitable[float]]) -> None:
        backoff_s = BACKOFF_MIN_S
        while not self._stopping.is_set():
            try:
                pause_s = await once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis errors, timeouts, a bad document: never kill the gateway
                self._failed(name, exc)
                pause_s = backoff_s * (0.5 + random.random())
                backoff_s = min(backoff_s * 2.0, BACKOFF_MAX_S)
            else:
                self._recovered(name)
                backoff_s = BACKOFF_MIN_S
            await sleep_unless(self._stopping, pause_s)

    def _failed(self, name: str, exc: BaseException) -> None:
        self.redis_errors += 1
        if name not in self._failing:
            self._failing.add(name)
            log.warning("sharing: %s failing (%s: %s); routing on local data", name, type(exc).__name__, exc)
        if name == "load-exchange":
            self._expire_peer_load()

    def _recovered(self, name: str) -> None:
        if name in self._failing:
            self._failing.discard(name)
            log.info("sharing: %s reconnected", name)

    # ---- prefixes -----------------------------------------------------------------------------

    async def _publish_prefixes_once(self) -> float:
        updates = self.build_updates(self._index.take_updates())
        if updates:
            pipe = self._redis.pipeline(transaction=False)
            for update in updates:
                pipe.xadd(
                    self._keys.prefix_stream,
                    {PREFIX_STREAM_GATEWAY_FIELD: self._own_id, PREFIX_STREAM_FIELD: encode(update)},
                    maxlen=self.stream_maxlen,
                    approximate=True,
                )
            await pipe.execute()
            self.updates_sent += len(updates)
        return self.prefix_flush_interval_s

    def build_updates(self, insertions: list[tuple[int, tuple[int, ...], float]]) -> list[PrefixUpdate]:
        """This gateway's insertions as ``PrefixUpdate``s (``build_updates``)."""
        return build_updates(self.gateway_id, insertions)

    async def _read_prefixes(self) -> None:
        claims = self._peers.claims
        last_id: bytes | str | None = None
        backoff_s = BACKOFF_MIN_S
        while not self._stopping.is_set():
            try:
                if last_id is None:
                    last_id = await self._warm_start()
                # A short block: the loop must come back to see the stop flag (see stop()).
                response = await self._redis.xread(
                    {self._keys.prefix_stream: last_id}, count=500, block=self.read_block_ms
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._failed("prefix-read", exc)
                await sleep_unless(self._stopping, backoff_s * (0.5 + random.random()))
                backoff_s = min(backoff_s * 2.0, BACKOFF_MAX_S)
                continue
            self._recovered("prefix-read")
            backoff_s = BACKOFF_MIN_S
            for _stream, entries in response or ():
                for entry_id, fields in entries:
                    last_id = entry_id
                    self._apply_entry(fields)
            if self._peers.claims != claims:
                claims = self._peers.claims
                self._set_peer_load(self._peers.load(), self._peer_load_at_s)

    async def _warm_start(self) -> bytes | str:
        """Apply the recent history of the stream; return the id to read on from."""
        entries = await self._redis.xrevrange(self._keys.prefix_stream, count=self.warm_start_entries)
        if not entries:
            return "0-0"
        oldest_s = self._clock() - self._index.ttl_s
        for _entry_id, fields in reversed(entries):
            self._apply_entry(fields, oldest_s)
        return entries[0][0]

    def _apply_entry(self, fields: Mapping[bytes | str, bytes | str], oldest_s: float | None = None) -> None:
        if fields.get(_GATEWAY_FIELD_BYTES) == self._own_id:
            self.own_updates_skipped += 1  # our own insertions: already in the index, skip the decode
            return
        raw = fields.get(_UPDATE_FIELD_BYTES)
        if raw is None:
            raw = fields.get(PREFIX_STREAM_FIELD)
        if raw is None:
            self.updates_rejected += 1
            return
        try:
            update = decode(raw, PrefixUpdate)
        except (msgspec.DecodeError, msgspec.ValidationError, UnknownSchemaVersion):
            self.updates_rejected += 1
            return
        if update.gateway_id == self.gateway_id or (oldest_s is not None and update.ts < oldest_s):
            return
        now_s = self._clock()
        if oldest_s is None:  # live, not the warm start's history
            apply_peer_update(self._index, self._peers, update, now_s)
            delay_s = max(now_s - update.ts, 0.0)
            previous = self.peer_update_delay_s.get(update.gateway_id)
            self.peer_update_delay_s[update.gateway_id] = (
                delay_s if previous is None else previous + PEER_DELAY_SMOOTHING * (delay_s - previous)
            )
        else:
            self._index.apply_remote(_not_after(update, now_s))
        self.updates_applied += 1

    # ---- load ---------------------------------------------------------------------------------

    async def _exchange_load_once(self) -> float:
        now_s = self._clock()
        own = load_report(self.gateway_id, self.region, now_s, self._load_source())
        pipe = self._redis.pipeline(transaction=False)
        pipe.hset(self._keys.gateway_load, self.gateway_id, encode(own))
        pipe.hgetall(self._keys.gateway_load)
        _, entries = await pipe.execute()
        # The reports' ages as of their arrival here, the round trip included (``now_s`` is when
        # this gateway's own counts were taken, before it)
        now_s = self._clock()
        fresh: list[GatewayLoad] = []
        expired: list[bytes | str] = []
        ages = self._report_ages
        fresh_ages: dict[str, float] = {}
        for field, raw in entries.items():
            name = field.decode() if isinstance(field, bytes) else field
            if name == self.gateway_id:
                continue
            try:
                peer = decode(raw, GatewayLoad)
            except (msgspec.DecodeError, msgspec.ValidationError, UnknownSchemaVersion):
                continue
            # From its stamp, or from when that stamp first arrived here if longer: a peer whose
            # clock runs ahead would otherwise count for as long as it is ahead after it stopped.
            age_s = ages.age_s(name, peer.updated_at, now_s)
            if age_s > self.peer_stale_after_s:
                if age_s > PRUNE_AFTER_S:
                    expired.append(field)
                continue
            fresh.append(peer)
            fresh_ages[peer.gateway_id] = max(age_s, 0.0)
        ages.keep(field.decode() if isinstance(field, bytes) else field for field in entries)
        self.peer_report_age_s = fresh_ages
        for gone in set(self.peer_update_delay_s) - set(self.peer_report_age_s):
            del self.peer_update_delay_s[gone]  # a peer gone stale or away: no figure for it
        if expired:
            await self._redis.hdel(self._keys.gateway_load, *expired)
        self._peers.read_reports(fresh, now_s, self.peer_stale_after_s)
        self._set_peer_load(self._peers.load(), now_s)
        return self.load_interval_s

    def _set_peer_load(self, load: dict[int, NodeLoad], now_s: float) -> None:
        self._peer_load = MappingProxyType(load)
        self._peer_load_at_s = now_s
        if self._on_peer_load is not None:
            self._on_peer_load(self._peer_load)

    def _expire_peer_load(self) -> None:
        now_s = self._clock()
        if now_s - self._peer_load_at_s <= self.peer_stale_after_s:
            return
        # Nothing read for that long: how late the peers are is unknown, not the last figure.
        self.peer_update_delay_s.clear()
        self.peer_report_age_s.clear()
        if self._peer_load:
            self._peers = PeerLoad()
            self._set_peer_load({}, now_s)


class PeerLoad:
    """The other gateways' outstanding work as this gateway knows it: their last load reports,
    plus a claim for each prefix update they sent since (module docstring). No I/O: the event
    model (``simulator.replay``) keeps one per gateway too."""

    __slots__ = ("_claims", "_reported", "_reported_at", "claims")

    def __init__(self) -> None:
        self._reported: dict[int, NodeLoad] = {}
        self._reported_at: dict[str, float] = {}
        # (writer, its time of the update, node id, prefill tokens, when it arrived here on this
        # reader's clock), oldest first
        self._claims: deque[tuple[str, float, int, int, float]] = deque(maxlen=CLAIMS_MAX)
        self.claims = 0  # claims made so far: a reader republishes the load when it moved

    def read_reports(
        self, reports: Iterable[GatewayLoad], now_s: float | None = None, stale_after_s: float | None = None
    ) -> None:
        """The fresh peers' reports, just read: they replace the sum, and cover every claim of
        their writer made up to the report's time (on the writer's clock, like the claims'). With
        ``now_s`` and ``stale_after_s``: a claim whose writer has no fresh report (it stopped, died,
        or restarted under a new id) is dropped once older than that, as its report would be;
        before, such a claim counted as load until 10,000 newer ones pushed it out."""
        reports = list(reports)
        self._reported = peer_load_of(reports)
        self._reported_at = reported_at = {report.gateway_id: report.updated_at for report in reports}
        oldest_s = -math.inf if now_s is None or stale_after_s is None else now_s - stale_after_s
        kept = [
            claim
            for claim in self._claims
            if claim[1] > reported_at.get(claim[0], -math.inf)
            # aged by its stamp, or by its arrival here when a writer's clock runs ahead
            and (claim[0] in reported_at or min(claim[1], claim[4]) >= oldest_s)
        ]
        self._claims.clear()
        self._claims.extend(kept)

    def claim(self, update: PrefixUpdate, prefill_tokens: int, now_s: float | None = None) -> None:
        """A peer's update, read from the stream: one request it sent, unless its report is in.
        ``now_s``: this reader's clock as it arrives (default: the update's own stamp)."""
        if update.ts <= self._reported_at.get(update.gateway_id, -math.inf):
            return
        arrived_s = update.ts if now_s is None else now_s
        self._claims.append((update.gateway_id, update.ts, update.node_id, prefill_tokens, arrived_s))
        self.claims += 1

    def load(self) -> dict[int, NodeLoad]:
        """Node id -> the peers' reported load plus their claims since (a fresh dict)."""
        load = dict(self._reported)
        if not self._claims:
            return load
        extra: dict[int, list[int]] = {}
        for _, _, node_id, tokens, _ in self._claims:
            counts = extra.setdefault(node_id, [0, 0])
            counts[0] += 1
            counts[1] += tokens
        for node_id, (requests, tokens) in extra.items():
            base = load.get(node_id)
            if base is None:
                load[node_id] = NodeLoad(requests, tokens, 0, tokens)
            else:
                load[node_id] = NodeLoad(
                    base.outstanding_requests + requests,
                    base.outstanding_prefill_tokens + tokens,
                    base.home_requests,
                    base.outstanding_context_tokens + tokens,
                )
        return load


def apply_peer_update(
    index: SharedIndex, peers: PeerLoad, update: PrefixUpdate, now_s: float | None = None
) -> None:
    """Apply a peer's live update to ``index`` and claim its work in ``peers``: the prefill is the
    update's chunks ``index`` did not yet place on the node (what a miss there would compute).
    ``now_s``: this gateway's clock; the index takes an update stamped later as of now
    (``_not_after``), the claim keeps the peer's stamp (its reports are on the peer's clock too)."""
    node_id = update.node_id
    indexed = update if now_s is None else _not_after(update, now_s)
    placed = index.match_hashes(update.chunk_hashes, (node_id,), indexed.ts).get(node_id, 0)
    prefill_tokens = max(0, round(len(update.chunk_hashes) * index.chunk_tokens) - placed)
    index.apply_remote(indexed)
    peers.claim(update, prefill_tokens, now_s)


def _not_after(update: PrefixUpdate, now_s: float) -> PrefixUpdate:
    """``update`` stamped no later than ``now_s``. The index expires a node's entries older than its
    newest stamp less the TTL, so a peer whose clock runs ahead by more than the TTL emptied this
    gateway's index of that node on every update (and its own entries outlived the TTL by its skew)."""
    if update.ts <= now_s:
        return update
    return msgspec.structs.replace(update, ts=now_s)


def build_updates(
    gateway_id: str, insertions: list[tuple[int, tuple[int, ...], float]]
) -> list[PrefixUpdate]:
    """Merge insertions per node into ``PrefixUpdate``s, in the order a reader must apply them.

    A reader touches each update's hashes tail first. Concatenating a node's insertions (and
    keeping a repeated hash at its first place) keeps every chain's prefix touched after its
    extensions; an update split for size is emitted last part first for the same reason.
    """
    merged: dict[int, dict[int, None]] = {}
    latest_s: dict[int, float] = {}
    for node_id, hashes, ts in insertions:
        chain = merged.setdefault(node_id, {})
        for chunk in hashes:
            chain.setdefault(chunk, None)
        latest_s[node_id] = max(ts, latest_s.get(node_id, ts))
    updates: list[PrefixUpdate] = []
    for node_id, chain in merged.items():
        hashes = tuple(chain)
        starts = range(0, len(hashes), MAX_HASHES_PER_UPDATE)
        for start in reversed(starts):
            updates.append(
                PrefixUpdate(
                    schema_version=SCHEMA_VERSION,
                    gateway_id=gateway_id,
                    node_id=node_id,
                    chunk_hashes=hashes[start : start + MAX_HASHES_PER_UPDATE],
                    ts=latest_s[node_id],
                )
            )
    return updates


def load_report(
    gateway_id: str,
    region: str,
    now_s: float,
    load: tuple[Mapping[int, int], Mapping[int, int], Mapping[int, int], Mapping[int, int]],
) -> GatewayLoad:
    """This gateway's outstanding work as its peers read it (a ``LoadSource``'s counts, zeros left out)."""
    requests, prefill_tokens, home_requests, context_tokens = load
    return GatewayLoad(
        schema_version=SCHEMA_VERSION,
        gateway_id=gateway_id,
        region=region,
        updated_at=now_s,
        outstanding_requests={node: count for node, count in requests.items() if count},
        outstanding_prefill_tokens={node: count for node, count in prefill_tokens.items() if count},
        home_requests={node: count for node, count in home_requests.items() if count},
        outstanding_context_tokens={node: count for node, count in context_tokens.items() if count},
    )


def peer_load_of(peers: Iterable[GatewayLoad]) -> dict[int, NodeLoad]:
    """The peers' reports summed per node: what a gateway adds to its own in-flight counts."""
    totals: dict[int, list[int]] = {}
    for peer in peers:
        for node_id, count in peer.outstanding_requests.items():
            totals.setdefault(node_id, [0, 0, 0, 0])[0] += count
        for node_id, count in peer.outstanding_prefill_tokens.items():
            totals.setdefault(node_id, [0, 0, 0, 0])[1] += count
        for node_id, count in peer.home_requests.items():
            totals.setdefault(node_id, [0, 0, 0, 0])[2] += count
        for node_id, count in peer.outstanding_context_tokens.items():
            totals.setdefault(node_id, [0, 0, 0, 0])[3] += count
    return {
        node_id: NodeLoad(requests, tokens, home, context)
        for node_id, (requests, tokens, home, context) in totals.items()
    }
