"""A Redis lock so that a periodic task never overlaps itself, even across several workers."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import redis

from routing.contract import RedisKeys

log = logging.getLogger(__name__)

# Delete the lock only if it still holds our token: one that expired and was taken by another run
# stays theirs.
_RELEASE_LOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@contextmanager
def task_lock(client: redis.Redis, keys: RedisKeys, name: str, ttl_s: float) -> Iterator[bool]:
    """SET NX PX lock; yields whether it was acquired.

    The TTL is the task's hard time limit, so a killed worker's lock frees itself.
    """
    key = keys.lock(name)
    token = uuid.uuid4().hex
    acquired = bool(client.set(key, token, nx=True, px=max(1, int(ttl_s * 1000))))
    try:
        yield acquired
    finally:
        if acquired:
            try:
                client.eval(_RELEASE_LOCK, 1, key, token)
            except redis.RedisError:
                log.warning("could not release lock %s; it expires in %.0f s", key, ttl_s)
