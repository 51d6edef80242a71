"""A fleet change republishes the active policy after it commits (so these tests commit for real)."""

from __future__ import annotations

import pytest

from controlplane.connections import redis_client
from controlplane.fleet.models import Node
from controlplane.policies.models import PolicyVersion, RoutingPolicy
from simulator.harness import free_port
from tests.controlplane.support import LLAMA, live_snapshot

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def live(operator_client, fleet, redis_conn, cp_keys):
    """A published default policy; returns a reader of the live snapshot."""
    policy = RoutingPolicy.objects.create(name="default", algorithm="gorgo")
    assert operator_client.post(f"/api/v1/policies/{policy.pk}/publish/").status_code == 201
    return lambda: live_snapshot(redis_conn, cp_keys)


def node_named(snapshot, name: str):
    return next((n for n in snapshot.nodes if n.name == name), None)


def test_it_republishes_when_a_node_is_drained_and_enabled(operator_client, fleet, live) -> None:
    node = fleet.nodes["eu-central-1"]
    assert operator_client.post(f"/api/v1/nodes/{node.pk}/drain/").status_code == 200
    snapshot = live()
    assert (snapshot.version, node_named(snapshot, "eu-central-1").state) == (2, "draining")
    assert operator_client.post(f"/api/v1/nodes/{node.pk}/enable/").status_code == 200
    snapshot = live()
    assert (snapshot.version, node_named(snapshot, "eu-central-1").state) == (3, "active")
    assert PolicyVersion.objects.get(number=2).author_name == "system"
    assert PolicyVersion.objects.get(number=2).note.startswith("fleet change")


def test_it_republishes_a_new_node_with_its_models_once(operator_client, live) -> None:
    body = {
        "name": "eu-central-3",
        "region": "eu-central",
        "base_url": "http://127.0.0.1:9107",
        "models": [LLAMA],
    }
    assert operator_client.post("/api/v1/nodes/", body, format="json").status_code == 201
    snapshot = live()
    assert node_named(snapshot, "eu-central-3").models == (LLAMA,)
    # Node and models are saved in one transaction: one new version, not one per step.
    assert (snapshot.version, PolicyVersion.objects.count()) == (2, 2)


def test_it_republishes_when_a_node_is_edited(operator_client, fleet, live) -> None:
    node = fleet.nodes["ap-south-1"]
    response = operator_client.patch(
        f"/api/v1/nodes/{node.pk}/", {"prefill_tokens_per_s": 9000.0}, format="json"
    )
    assert response.status_code == 200
    snapshot = live()
    assert (snapshot.version, node_named(snapshot, "ap-south-1").prefill_tokens_per_s) == (2, 9000.0)


def test_it_republishes_when_a_node_is_deleted(operator_client, fleet, live) -> None:
    node = fleet.nodes["ap-south-2"]
    node.set_state("disabled")  # published as version 2
    assert operator_client.delete(f"/api/v1/nodes/{node.pk}/").status_code == 204
    snapshot = live()
    assert snapshot.version == 3
    assert node_named(snapshot, "ap-south-2") is None
    assert len(snapshot.nodes) == 5


def test_it_does_not_republish_an_unchanged_fleet(operator_client, fleet, live) -> None:
    node = fleet.nodes["us-east-1"]
    assert operator_client.post(f"/api/v1/nodes/{node.pk}/enable/").status_code == 200  # already active
    operator_client.patch(f"/api/v1/nodes/{node.pk}/", {"gpu_type": node.gpu_type}, format="json")
    assert live().version == 1
    assert PolicyVersion.objects.count() == 1


def test_it_keeps_the_fleet_change_when_redis_is_down(operator_client, fleet, live, settings) -> None:
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    redis_client.cache_clear()
    node = fleet.nodes["us-east-2"]
    assert operator_client.post(f"/api/v1/nodes/{node.pk}/drain/").status_code == 200
    assert Node.objects.get(pk=node.pk).state == "draining"
    assert PolicyVersion.objects.count() == 1  # nothing recorded that the gateways never saw
