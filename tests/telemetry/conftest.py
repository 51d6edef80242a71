"""Fixtures of the telemetry tests: a Redis namespace wired into settings, a fleet of stub nodes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import redis
from rest_framework.test import APIClient

from controlplane.connections import redis_client
from controlplane.fleet.models import Node, Region
from routing.contract import RedisKeys
from telemetry.probes import NodeHTTP
from tests.support.vllm_stub import StubNode

REGIONS = {
    "us-east": ("US East", 39.04, -77.49),
    "eu-central": ("EU Central", 50.11, 8.68),
    "ap-south": ("AP South", 19.08, 72.88),
}


@dataclass
class TelemetryRedis:
    client: redis.Redis
    keys: RedisKeys


@pytest.fixture
def tel(settings, redis_keys: RedisKeys) -> Iterator[TelemetryRedis]:
    """This test's own Redis namespace, used by the workers' code and the channel layer."""
    settings.GORGO_REDIS_PREFIX = redis_keys.prefix
    settings.CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [settings.REDIS_URL], "prefix": f"{redis_keys.prefix}:asgi"},
        }
    }
    yield TelemetryRedis(client=redis_client(), keys=redis_keys)


@pytest.fixture
def http() -> Iterator[NodeHTTP]:
    """A private node client (not the process-wide one), closed afterwards."""
    client = NodeHTTP(keepalive_s=60.0, max_parallel=8)
    yield client
    client.close()


@pytest.fixture
def stubs() -> Iterator[Callable[..., StubNode]]:
    started: list[StubNode] = []

    def start(**options) -> StubNode:
        stub = StubNode(**options).start_in_thread()
        started.append(stub)
        return stub

    yield start
    for stub in started:
        stub.stop_thread()


def make_regions(*slugs: str) -> dict[str, Region]:
    regions = {}
    for slug in slugs or tuple(REGIONS):
        name, latitude, longitude = REGIONS[slug]
        regions[slug], _ = Region.objects.get_or_create(
            slug=slug, defaults={"name": name, "latitude": latitude, "longitude": longitude}
        )
    return regions


def make_node(name: str, region: Region, base_url: str, **fields) -> Node:
    return Node.objects.create(name=name, region=region, base_url=base_url, **fields)


@pytest.fixture
def viewer_api(db, django_user_model) -> APIClient:
    """An API client logged in as a plain (viewer) user."""
    user = django_user_model.objects.create_user(username="viewer")  # no password: no slow hashing
    client = APIClient()
    client.force_authenticate(user)
    return client
