"""Fixtures of the control-plane tests: a Redis namespace per test, accounts, API clients, a fleet."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from rest_framework.test import APIClient

from controlplane.accounts import Account, ensure_account
from controlplane.connections import redis_client
from routing.contract import RedisKeys
from tests.controlplane.support import Fleet, client_for, make_fleet


@pytest.fixture(autouse=True)
def cp_keys(settings, redis_keys: RedisKeys) -> Iterator[RedisKeys]:
    """Publish into this test's own Redis namespace: versions restart at 1 in every test's database,
    and the compare-and-set write would refuse them under a newer snapshot left by another test."""
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
def operator_client(operator: Account) -> APIClient:
    return client_for(operator.token)


@pytest.fixture
def viewer_client(viewer: Account) -> APIClient:
    return client_for(viewer.token)


@pytest.fixture
def anon_client() -> APIClient:
    return client_for(None)


@pytest.fixture
def fleet(db) -> Fleet:
    return make_fleet()
