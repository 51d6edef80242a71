"""The periodic reconcile publishes what a failed fleet-change republish missed."""

from __future__ import annotations

import pytest

from controlplane.connections import redis_client
from controlplane.fleet.models import Node
from controlplane.policies import publishing
from controlplane.policies.models import PolicyVersion, RoutingPolicy
from controlplane.policies.tasks import reconcile
from tests.controlplane.support import live_snapshot

pytestmark = pytest.mark.django_db(transaction=True)


def test_it_publishes_a_fleet_change_that_redis_missed(
    fleet, redis_conn, redis_url, cp_keys, settings
) -> None:
    policy = RoutingPolicy.objects.create(name="default", algorithm="least_load")
    assert publishing.publish(policy).version.number == 1
    node = Node.objects.get(name="us-east-1")

    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # Redis unreachable during the change
    redis_client.cache_clear()
    node.state = "draining"
    node.save()  # the on-commit republish fails quietly; the change itself is kept
    assert PolicyVersion.objects.count() == 1
    assert reconcile() is None  # still unreachable: nothing recorded

    settings.REDIS_URL = redis_url
    redis_client.cache_clear()
    assert reconcile() == 2
    snapshot = live_snapshot(redis_conn, cp_keys)
    assert snapshot is not None and snapshot.version == 2
    assert {n.name: n.state for n in snapshot.nodes}["us-east-1"] == "draining"
    assert reconcile() == 2  # nothing changed since: no new version


def test_it_does_nothing_without_an_active_policy(fleet) -> None:
    assert reconcile() is None
    assert PolicyVersion.objects.count() == 0
