"""Live state in Redis (what the gateways read) and pushes to the dashboard's channel group.

Several workers write at once (one probe worker per region, scrapes, health transitions), so every
write here is atomic on the Redis side: per-node live documents are merged field by field in a Lua
script instead of read-modify-written from Python, the RTT EWMA is updated in a script, and the
RTT table is rebuilt under WATCH so the last writer always writes the newest complete table.

Keys shared with the gateways come from ``routing.contract.RedisKeys``. The workers' private
bookkeeping (EWMA state, scrape baselines, health streaks) lives under ``<prefix>:telemetry:*``
(``TelemetryKeys``); nothing outside this app reads it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import redis
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

from routing import contract
from routing.contract import NodeLiveState, RedisKeys, RTTEntry, RTTTable
from telemetry.groups import DASHBOARD_GROUP, DashboardUpdate

log = logging.getLogger(__name__)

# How fast the RTT average follows new samples, and how fast the jitter (mean deviation) does.
RTT_EWMA_ALPHA = 0.3
RTT_JITTER_GAIN = 0.25
STATE_TTL_S = 24 * 3600  # private bookkeeping of a node that vanished expires by itself


@dataclass(frozen=True, slots=True)
class TelemetryKeys:
    """The workers' private Redis keys, under the same prefix as the contract's keys."""

    prefix: str

    def rtt_state(self, region: str, node_id: int) -> str:
        """HASH: ewma_ms, jitter_ms, samples, updated_at of one (region, node) pair."""
        return f"{self.prefix}:telemetry:rtt:{region}:{node_id}"

    @property
    def rtt_entries(self) -> str:
        """HASH: "region|node id" -> RTTEntry (JSON); the RTT table is built from it."""
        return f"{self.prefix}:telemetry:rtt-entries"

    def scrape_baseline(self, node_id: int) -> str:
        """STRING: the node's previous ``Scrape`` (cumulative values), for deltas."""
        return f"{self.prefix}:telemetry:scrape:{node_id}"

    def health_streaks(self, node_id: int) -> str:
        """HASH: "<check>:ok" / "<check>:fail" consecutive outcome counts of one node."""
        return f"{self.prefix}:telemetry:health:{node_id}"


def telemetry_keys(keys: RedisKeys) -> TelemetryKeys:
    return TelemetryKeys(prefix=keys.prefix)


def rtt_entry_field(region: str, node_id: int) -> str:
    return f"{region}|{node_id}"


# ---------------------------------------------------------------------------------------------
# Locks
# ---------------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------------
# Node live state
# ---------------------------------------------------------------------------------------------

# KEYS[1] live nodes hash; ARGV: field, base document (used when absent or unreadable), patch,
# channel ('' = do not publish). Merges the patch into the stored document in one step.
_MERGE_LIVE = """
local doc = nil
local current = redis.call('HGET', KEYS[1], ARGV[1])
if current then
  local ok, decoded = pcall(cjson.decode, current)
  if ok and type(decoded) == 'table' then doc = decoded end
end
if not doc then doc = cjson.decode(ARGV[2]) end
for k, v in pairs(cjson.decode(ARGV[3])) do doc[k] = v end
local encoded = cjson.encode(doc)
redis.call('HSET', KEYS[1], ARGV[1], encoded)
if ARGV[4] ~= '' then redis.call('PUBLISH', ARGV[4], KEYS[1]) end
return encoded
"""


def merge_node_live(
    client: redis.Redis,
    keys: RedisKeys,
    patches: Mapping[int, Mapping[str, Any]],
    *,
    healthy_default: Mapping[int, bool],
    publish: bool = True,
) -> None:
    """Merge field patches into each node's ``NodeLiveState``; announce once on ``live_channel``.

    ``healthy_default`` seeds ``healthy`` for a node with no live document yet (a node without one
    counts as healthy for the gateways, so an unknown node gets ``True``).
    """
    if not patches:
        return
    now = time.time()
    script = client.register_script(_MERGE_LIVE)
    with client.pipeline(transaction=False) as pipe:
        for node_id, patch in patches.items():
            base = NodeLiveState(
                schema_version=contract.SCHEMA_VERSION,
                node_id=node_id,
                healthy=healthy_default.get(node_id, True),
                updated_at=now,
            )
            full_patch = {"schema_version": contract.SCHEMA_VERSION, "updated_at": now, **patch}
            script(
                keys=[keys.live_nodes],
                args=[str(node_id), contract.encode(base), msgspec.json.encode(full_patch), ""],
                client=pipe,
            )
        if publish:
            pipe.publish(keys.live_channel, keys.live_nodes)
        pipe.execute()


def read_live_nodes(client: redis.Redis, keys: RedisKeys) -> dict[int, NodeLiveState]:
    """Every readable node document (unreadable ones are skipped, as a gateway would)."""
    result: dict[int, NodeLiveState] = {}
    for raw_id, raw_doc in client.hgetall(keys.live_nodes).items():
        try:
            state = contract.decode(raw_doc, NodeLiveState)
        except (msgspec.DecodeError, msgspec.ValidationError, contract.UnknownSchemaVersion):
            log.warning("unreadable live state for node %r", raw_id)
            continue
        result[state.node_id] = state
    return result


# ---------------------------------------------------------------------------------------------
# RTT
# ---------------------------------------------------------------------------------------------

# KEYS[1] pair state; ARGV: sample ms, alpha, jitter gain, now, ttl. Returns ewma, jitter, samples.
_UPDATE_EWMA = """
local state = redis.call('HMGET', KEYS[1], 'ewma_ms', 'jitter_ms', 'samples')
local sample = tonumber(ARGV[1])
local ewma, jitter, n = tonumber(state[1]), tonumber(state[2]), tonumber(state[3]) or 0
if not ewma then
  ewma, jitter = sample, 0
else
  jitter = jitter + tonumber(ARGV[3]) * (math.abs(sample - ewma) - jitter)
  ewma = ewma + tonumber(ARGV[2]) * (sample - ewma)
end
n = n + 1
redis.call('HSET', KEYS[1], 'ewma_ms', tostring(ewma), 'jitter_ms', tostring(jitter), 'samples', n, 'updated_at', ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[5])
return {tostring(ewma), tostring(jitter), n}
"""


def update_rtt(
    client: redis.Redis, keys: RedisKeys, region: str, samples_ms: Mapping[int, float], now: float
) -> list[RTTEntry]:
    """Fold one round of samples (node id -> ms) from ``region`` into the per-pair EWMA and jitter."""
    if not samples_ms:
        return []
    private = telemetry_keys(keys)
    script = client.register_script(_UPDATE_EWMA)
    with client.pipeline(transaction=False) as pipe:
        for node_id, sample_ms in samples_ms.items():
            script(
                keys=[private.rtt_state(region, node_id)],
                args=[repr(float(sample_ms)), RTT_EWMA_ALPHA, RTT_JITTER_GAIN, repr(now), STATE_TTL_S],
                client=pipe,
            )
        results = pipe.execute()
    entries = [
        RTTEntry(
            region=region,
            node_id=node_id,
            rtt_ms=round(float(ewma), 3),
            jitter_ms=round(float(jitter), 3),
            samples=int(count),
            updated_at=now,
        )
        for node_id, (ewma, jitter, count) in zip(samples_ms, results, strict=True)
    ]
    client.hset(
        private.rtt_entries,
        mapping={rtt_entry_field(e.region, e.node_id): contract.encode(e) for e in entries},
    )
    return entries


def publish_rtt_table(client: redis.Redis, keys: RedisKeys, now: float, attempts: int = 20) -> RTTTable:
    """Rebuild ``live_rtt`` from every pair's latest entry and announce it.

    WATCH makes the SET fail if another worker changed an entry after we read them; we then
    read again, so the table written last always holds every pair's newest entry.
    """
    private = telemetry_keys(keys)
    with client.pipeline(transaction=True) as pipe:
        for _ in range(attempts):
            try:
                pipe.watch(private.rtt_entries)
                entries = sorted(
                    (_decode_entry(raw) for raw in pipe.hvals(private.rtt_entries)),
                    key=lambda e: (e.region, e.node_id) if e else ("", 0),
                )
                table = RTTTable(
                    schema_version=contract.SCHEMA_VERSION,
                    updated_at=now,
                    entries=tuple(e for e in entries if e is not None),
                )
                pipe.multi()
                pipe.set(keys.live_rtt, contract.encode(table))
                pipe.publish(keys.live_channel, keys.live_rtt)
                pipe.execute()
                return table
            except redis.WatchError:
                continue
    raise redis.RedisError(f"RTT table kept changing under us ({attempts} attempts)")


def read_rtt_table(client: redis.Redis, keys: RedisKeys) -> RTTTable | None:
    raw = client.get(keys.live_rtt)
    if raw is None:
        return None
    try:
        return contract.decode(raw, RTTTable)
    except (msgspec.DecodeError, msgspec.ValidationError, contract.UnknownSchemaVersion):
        log.warning("unreadable RTT table in %s", keys.live_rtt)
        return None


@dataclass(frozen=True, slots=True)
class LiveState:
    """What the gateways see now: each node's live document and the RTT table.

    ``error`` says why it is empty when Redis could not be read; readers (the API, the dashboard)
    still answer with what the database knows.
    """

    nodes: dict[int, NodeLiveState]
    rtt: RTTTable | None
    error: str = ""


def read_live_state(client: redis.Redis, keys: RedisKeys) -> LiveState:
    """The one reader of live state for the control plane's API and pages (never raises for Redis)."""
    try:
        return LiveState(nodes=read_live_nodes(client, keys), rtt=read_rtt_table(client, keys))
    except redis.RedisError as exc:
        log.warning("live state unavailable: %s", exc)
        return LiveState(nodes={}, rtt=None, error=str(exc))


def forget_missing(
    client: redis.Redis, keys: RedisKeys, node_ids: Iterable[int], region_slugs: Iterable[str]
) -> int:
    """Drop live state and RTT entries of nodes and regions that no longer exist. Returns how many."""
    nodes, regions = {str(n) for n in node_ids}, set(region_slugs)
    private = telemetry_keys(keys)
    stale_live = [f for f in client.hkeys(keys.live_nodes) if f.decode() not in nodes]
    stale_rtt = []
    for raw in client.hkeys(private.rtt_entries):
        region, _, node = raw.decode().partition("|")
        if region not in regions or node not in nodes:
            stale_rtt.append(raw)
    if stale_live:
        client.hdel(keys.live_nodes, *stale_live)
    if stale_rtt:
        client.hdel(private.rtt_entries, *stale_rtt)
    return len(stale_live) + len(stale_rtt)


def _decode_entry(raw: bytes) -> RTTEntry | None:
    try:
        return contract.decode(raw, RTTEntry)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


# ---------------------------------------------------------------------------------------------
# Dashboard pushes
# ---------------------------------------------------------------------------------------------


def push_dashboard(update: DashboardUpdate) -> bool:
    """Send one update to the dashboard group through the channel layer. Never raises.

    A dashboard that is not listening, or a channel layer that is down, must not fail a
    telemetry round: the data is in Redis and the database either way.
    """
    layer = get_channel_layer()
    if layer is None:
        return False
    try:
        async_to_sync(layer.group_send)(DASHBOARD_GROUP, update.as_message())
    except Exception as exc:  # any layer failure (connection, serialisation) is only logged
        log.warning("dashboard push %s failed: %s", update.type_name, exc)
        return False
    return True
