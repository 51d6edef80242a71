"""The one writer of the compiled policy snapshot and the client key set: compare-and-set, then announce.

Django-free, beside ``routing/contract.py`` whose key and channel names it uses: the control plane
publishes through it, and so do the tests and benchmarks that stand in for the control plane, so
every publisher has the same compare-and-set. A snapshot only replaces an older version, never a
newer one, so two publishers racing cannot move the gateways backwards. Redis errors propagate
(``redis.RedisError``); callers decide what they mean.
"""

from __future__ import annotations

import msgspec
import redis
import redis.asyncio as aioredis

from routing import contract
from routing.algorithms import REGISTRY
from routing.contract import ClientKeySet, KeySetAnnouncement, PolicyAnnouncement, PolicySnapshot, RedisKeys

# The algorithms the gateways of this tree run, by name: what a publisher may put in a snapshot.
# The control plane checks it against the contract's ``ALGORITHMS`` at every start (its
# ``policies.E001`` system check) through here, never reaching into the gateway's own modules.
GATEWAY_ALGORITHMS = REGISTRY

# KEYS[1] = current snapshot key; ARGV = snapshot json, version, channel, announcement json.
# Writes only when the stored snapshot is older (or absent); returns 1 when written.
SET_IF_NEWER = """
local current = redis.call('GET', KEYS[1])
if current then
  local ok, doc = pcall(cjson.decode, current)
  if ok and type(doc) == 'table' and tonumber(doc['version']) and tonumber(doc['version']) > tonumber(ARGV[2]) then
    return 0
  end
end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('PUBLISH', ARGV[3], ARGV[4])
return 1
"""


def _script_args(keys: RedisKeys, snapshot: PolicySnapshot) -> tuple[str, int, str, bytes, int, str, bytes]:
    announcement = PolicyAnnouncement(
        schema_version=contract.SCHEMA_VERSION, version=snapshot.version, checksum=snapshot.checksum
    )
    return (
        SET_IF_NEWER,
        1,
        keys.policy_current,
        contract.encode(snapshot),
        snapshot.version,
        keys.policy_channel,
        contract.encode(announcement),
    )


def write_snapshot(client: redis.Redis, keys: RedisKeys, snapshot: PolicySnapshot) -> bool:
    """Write ``snapshot`` and announce it unless Redis holds a newer one; True when written."""
    return bool(client.eval(*_script_args(keys, snapshot)))


async def write_snapshot_async(client: aioredis.Redis, keys: RedisKeys, snapshot: PolicySnapshot) -> bool:
    """``write_snapshot`` for an asyncio Redis client."""
    return bool(await client.eval(*_script_args(keys, snapshot)))


def stored_version(raw: bytes | None) -> int:
    """The version of a stored snapshot document (0 when absent or unreadable: the next write replaces it)."""
    if raw is None:
        return 0
    try:
        return int(msgspec.json.decode(raw).get("version", 0))
    except (msgspec.DecodeError, AttributeError, TypeError, ValueError):
        return 0


def current_version(client: redis.Redis, keys: RedisKeys) -> int:
    """The version of the snapshot the gateways run now (0 when there is none or it is unreadable)."""
    return stored_version(client.get(keys.policy_current))


# ---- client keys (issue 12) -------------------------------------------------------------------

# KEYS[1] = key-set key; ARGV = key-set json, version, channel, announcement json.
# Same compare-and-set as the snapshot: a key set only replaces an older one.
_SET_KEYS_IF_NEWER = SET_IF_NEWER


def _key_set_args(keys: RedisKeys, key_set: ClientKeySet) -> tuple[str, int, str, bytes, int, str, bytes]:
    announcement = KeySetAnnouncement(schema_version=contract.SCHEMA_VERSION, version=key_set.version)
    return (
        _SET_KEYS_IF_NEWER,
        1,
        keys.key_set,
        contract.encode(key_set),
        key_set.version,
        keys.key_channel,
        contract.encode(announcement),
    )


def write_key_set(client: redis.Redis, keys: RedisKeys, key_set: ClientKeySet) -> bool:
    """Write ``key_set`` (hashes only) and announce it unless Redis holds a newer one; True when written."""
    return bool(client.eval(*_key_set_args(keys, key_set)))


async def write_key_set_async(client: aioredis.Redis, keys: RedisKeys, key_set: ClientKeySet) -> bool:
    """``write_key_set`` for an asyncio Redis client (tests, benchmarks)."""
    return bool(await client.eval(*_key_set_args(keys, key_set)))


def read_last_used(client: redis.Redis, keys: RedisKeys) -> dict[str, float]:
    """Key id -> unix seconds of last use, as the gateways recorded it."""
    raw = client.hgetall(keys.key_last_used)
    result: dict[str, float] = {}
    for key_id, value in raw.items():
        try:
            result[key_id.decode()] = float(value)
        except (UnicodeDecodeError, ValueError):
            continue
    return result
