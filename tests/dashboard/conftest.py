"""Fixtures of the dashboard tests: a Redis namespace per test, accounts, a small fleet, a policy."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from django.test import Client

from controlplane.accounts import Account, ensure_account
from controlplane.connections import redis_client
from controlplane.policies.models import RoutingPolicy
from routing.contract import RedisKeys
from tests.controlplane.support import LLAMA, Fleet, make_fleet

__all__ = ["LLAMA", "Fleet"]  # the dashboard tests import these from here


@pytest.fixture(autouse=True)
def dash_keys(settings, redis_keys: RedisKeys) -> Iterator[RedisKeys]:
    """Publish and read live state in this test's own Redis namespace (deleted afterwards)."""
    settings.GORGO_REDIS_PREFIX = redis_keys.prefix
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
def operator_client(operator: Account) -> Client:
    client = Client()
    client.force_login(operator.user)
    return client


@pytest.fixture
def viewer_client(viewer: Account) -> Client:
    client = Client()
    client.force_login(viewer.user)
    return client


@pytest.fixture
def fleet(db) -> Fleet:
    return make_fleet()


@pytest.fixture
def policy(fleet: Fleet) -> RoutingPolicy:
    return RoutingPolicy.objects.create(name="default", algorithm="gorgo", params={"w_rtt": 1.0})
