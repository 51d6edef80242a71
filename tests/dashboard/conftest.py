"""Fixtures of the dashboard tests: a Redis namespace per test, accounts, a small fleet, a policy."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis
from django.test import Client

from controlplane.fleet.accounts import Account, ensure_account
from controlplane.fleet.models import Model, Node, Region
from controlplane.policies.models import RoutingPolicy
from controlplane.policies.publishing import redis_client
from routing.contract import RedisKeys

LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
REGIONS = {
    "us-east": ("US East (Ashburn)", 39.04, -77.49),
    "eu-central": ("EU Central (Frankfurt)", 50.11, 8.68),
    "ap-south": ("AP South (Mumbai)", 19.08, 72.88),
}


@dataclass(frozen=True)
class Fleet:
    """Three regions, one model, two nodes per region (nothing listens on their ports)."""

    regions: dict[str, Region]
    model: Model
    nodes: dict[str, Node]


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
    regions = {
        slug: Region.objects.create(slug=slug, name=name, latitude=lat, longitude=lon)
        for slug, (name, lat, lon) in REGIONS.items()
    }
    model = Model.objects.create(name=LLAMA)
    nodes = {}
    port = 9201
    for slug, region in regions.items():
        for index in (1, 2):
            node = Node.objects.create(
                name=f"{slug}-{index}", region=region, base_url=f"http://127.0.0.1:{port}"
            )
            node.served_models.add(model)
            nodes[node.name] = node
            port += 1
    return Fleet(regions=regions, model=model, nodes=nodes)


@pytest.fixture
def policy(fleet: Fleet) -> RoutingPolicy:
    return RoutingPolicy.objects.create(name="default", algorithm="gorgo", params={"w_rtt": 1.0})
