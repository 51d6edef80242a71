"""Fixtures the control-plane and dashboard tests share (imported by both conftests).

A Redis namespace per test, the two kinds of account, a Redis connection and the small fleet.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from controlplane.accounts import Account, ensure_account
from controlplane.connections import redis_client
from routing.contract import RedisKeys
from tests.controlplane.support import Fleet, make_fleet


@pytest.fixture(autouse=True)
def cp_keys(settings, redis_keys: RedisKeys) -> Iterator[RedisKeys]:
    """Publish and read live state in this test's own Redis namespace: versions restart at 1 in
    every test's database, and the compare-and-set write would refuse them under a newer snapshot
    left by another test."""
    settings.GORGO_REDIS_PREFIX = redis_keys.prefix
    # Accounts are made in many tests; the production hasher is slow on purpose.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    redis_client.cache_clear()
    yield redis_keys
    redis_client.cache_clear()


@pytest.fixture
def redis_conn(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def operator(db) -> Account:
    return ensure_account("op", password="operator-password-1")


@pytest.fixture
def viewer(db) -> Account:
    return ensure_account("watcher", password="viewer-password-1", viewer=True)


@pytest.fixture
def fleet(db) -> Fleet:
    return make_fleet()
