"""The one writer of the compiled policy snapshot and the client key set: compare-and-set, then announce.

Both documents go through one function (``write``, or ``write_async`` for asyncio clients) and one
Lua script: only the key, the channel and the announcement differ, and those follow from the
document's type.

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

# KEYS[1] = the document's key; ARGV = its json, its version, its channel, the announcement json.
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


Document = PolicySnapshot | ClientKeySet  # what the writer publishes: the policy, the client keys


def _script_args(keys: RedisKeys, document: Document) -> tuple[str, int, str, bytes, int, str, bytes]:
    """The compare-and-set's arguments for ``document``: its key, its channel, its announcement."""
    if isinstance(document, PolicySnapshot):
        key, channel = keys.policy_current, keys.policy_channel
        announcement: PolicyAnnouncement | KeySetAnnouncement = PolicyAnnouncement(
            schema_version=contract.SCHEMA_VERSION, version=document.version, checksum=document.checksum
        )
    else:
        key, channel = keys.key_set, keys.key_channel
        announcement = KeySetAnnouncement(schema_version=contract.SCHEMA_VERSION, version=document.version)
    return (
        SET_IF_NEWER,
        1,
        key,
        contract.encode(document),
        document.version,
        channel,
        contract.encode(announcement),
    )


def write(client: redis.Redis, keys: RedisKeys, document: Document) -> bool:
    """Write ``document`` (the snapshot, or the key set: hashes only) and announce it unless Redis
    holds a newer one; True when written."""
    return bool(client.eval(*_script_args(keys, document)))


async def write_async(client: aioredis.Redis, keys: RedisKeys, document: Document) -> bool:
    """``write`` for an asyncio Redis client (tests and benchmarks standing in for the control plane)."""
    return bool(await client.eval(*_script_args(keys, document)))


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


# ---- client keys (issue 12): written by ``write`` like the snapshot; their use read back here


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
