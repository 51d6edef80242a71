"""A burst of fleet changes is published as one version that says what changed."""

from __future__ import annotations

import pytest
import redis

from controlplane.fleet.models import Node
from controlplane.policies import publishing
from controlplane.policies.models import PolicyVersion, RoutingPolicy
from controlplane.policies.tasks import describe_changes, republish_fleet_changes
from tests.controlplane.support import LLAMA, live_snapshot

pytestmark = pytest.mark.django_db(transaction=True)


def queued_tasks(client: redis.Redis, settings) -> int:
    """Messages waiting on the default Celery queue (no worker runs in these tests)."""
    prefix = settings.CELERY_BROKER_TRANSPORT_OPTIONS["global_keyprefix"]
    return client.llen(f"{prefix}{settings.CELERY_TASK_DEFAULT_QUEUE}")


@pytest.fixture
def coalescing(settings):
    settings.GORGO_REPUBLISH_DELAY_S = 2.0


def test_a_burst_of_fleet_changes_becomes_one_version(
    operator_client, fleet, coalescing, redis_conn, cp_keys, settings
) -> None:
    policy = RoutingPolicy.objects.create(name="default", algorithm="gorgo")
    assert operator_client.post(f"/api/v1/policies/{policy.pk}/publish/").status_code == 201
    queued_before = queued_tasks(redis_conn, settings)

    for name in ("us-east-1", "eu-central-1", "ap-south-1"):
        assert operator_client.post(f"/api/v1/nodes/{fleet.nodes[name].pk}/drain/").status_code == 200
    for name in ("us-east-1", "eu-central-1"):
        assert operator_client.post(f"/api/v1/nodes/{fleet.nodes[name].pk}/enable/").status_code == 200
    body = {
        "name": "eu-central-3",
        "region": "eu-central",
        "base_url": "http://127.0.0.1:9107",
        "models": [LLAMA],
    }
    assert operator_client.post("/api/v1/nodes/", body, format="json").status_code == 201

    # Nothing published yet, and one run scheduled for the whole burst.
    assert PolicyVersion.objects.count() == 1
    assert queued_tasks(redis_conn, settings) - queued_before == 1

    assert republish_fleet_changes() == 2  # what the worker runs when the countdown ends
    version = PolicyVersion.objects.get(number=2)
    assert version.note.startswith("fleet change: node us-east-1 changed; node eu-central-1 changed")
    assert "node eu-central-3 added" in version.note
    snapshot = live_snapshot(redis_conn, cp_keys)
    states = {n.name: n.state for n in snapshot.nodes}
    assert (snapshot.version, states["ap-south-1"], states["us-east-1"], "eu-central-3" in states) == (
        2,
        "draining",
        "active",
        True,
    )
    assert republish_fleet_changes() is None  # nothing new: no version
    assert PolicyVersion.objects.count() == 2

    # The next change starts a new burst with a run of its own.
    Node.objects.get(name="us-east-2").set_state("draining")
    assert queued_tasks(redis_conn, settings) - queued_before == 2
    assert republish_fleet_changes() == 3


def test_a_burst_while_redis_is_down_waits_for_reconcile(
    coalescing, operator_client, fleet, settings
) -> None:
    policy = RoutingPolicy.objects.create(name="default", algorithm="gorgo")
    assert operator_client.post(f"/api/v1/policies/{policy.pk}/publish/").status_code == 201
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    publishing.redis_client.cache_clear()
    node = fleet.nodes["us-east-1"]
    assert operator_client.post(f"/api/v1/nodes/{node.pk}/drain/").status_code == 200  # kept, logged
    assert Node.objects.get(pk=node.pk).state == "draining"
    assert PolicyVersion.objects.count() == 1


def test_the_note_lists_changes_once_and_stays_within_its_length() -> None:
    assert describe_changes(["node a changed", "node a changed", "node b added"]) == (
        "fleet change: node a changed; node b added"
    )
    note = describe_changes([f"node node-{i} changed" for i in range(200)])
    assert len(note) <= 500
    assert note.startswith("fleet change: node node-0 changed; node node-1 changed")
    assert note.endswith(" more)")
