"""The control plane's connections to Redis: one client per process, and the key names it uses."""

from __future__ import annotations

from functools import cache

import redis
from django.conf import settings

from routing.contract import RedisKeys


@cache
def redis_client() -> redis.Redis:
    """The control plane's Redis client (one per process; short timeouts so the API fails fast)."""
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2.0, socket_connect_timeout=2.0)


def redis_keys() -> RedisKeys:
    """Key and channel names under this deployment's prefix (``GORGO_REDIS_PREFIX``)."""
    return RedisKeys(prefix=settings.GORGO_REDIS_PREFIX)
