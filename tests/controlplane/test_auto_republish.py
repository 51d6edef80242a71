"""A fleet change republishes the active policy after it commits (so these tests commit for real)."""

from __future__ import annotations

import threading

import pytest
from django.db import connection

from controlplane.connections import redis_client
from controlplane.fleet.models import Node
from controlplane.policies import publishing
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


def test_a_fleet_republish_never_brings_back_the_policy_an_operator_replaced_meanwhile(
    fleet, redis_conn, cp_keys, monkeypatch
) -> None:
    """A node is drained (its republish reads which policy is live) while an operator publishes
    another policy. The republish read the live version before it took the publish lock: the
    operator's publish committed in between, and the republish then published the old policy
    over it, with the new fleet. The gateways went back to the policy the operator had replaced,
    and nobody was told. It now reads what is live under the lock, so it waits for the publish."""
    if connection.vendor != "postgresql":
        pytest.skip("two connections writing at once: PostgreSQL (SQLite serialises whole transactions)")
    replaced = RoutingPolicy.objects.create(name="replaced", algorithm="gorgo")
    chosen = RoutingPolicy.objects.create(name="chosen", algorithm="least_load", params={})
    publishing.publish(replaced)
    Node.objects.filter(pk=fleet.nodes["eu-central-1"].pk).update(state="draining")  # no signal: by hand
    read, published = threading.Event(), threading.Event()
    real_live_version = publishing.live_version
    republisher: list[int] = []

    def live_version_then_wait():
        live = real_live_version()
        if threading.get_ident() in republisher and not read.is_set():
            read.set()
            published.wait(timeout=3)  # the operator's publish lands here, unless it must wait for this one
        return live

    monkeypatch.setattr(publishing, "live_version", live_version_then_wait)
    errors: list[BaseException] = []

    def fleet_change() -> None:
        republisher.append(threading.get_ident())
        try:
            publishing.republish_active("node eu-central-1 changed")
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            read.set()
            connection.close()

    def operator_publishes() -> None:
        read.wait(timeout=5)
        try:
            publishing.publish(RoutingPolicy.objects.get(pk=chosen.pk), note="by hand")
        except BaseException as exc:
            errors.append(exc)
        finally:
            published.set()
            connection.close()

    threads = [threading.Thread(target=fleet_change), threading.Thread(target=operator_publishes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert not errors, errors
    live = PolicyVersion.objects.order_by("-number").first()
    assert live.policy == chosen and live.note == "by hand"
    assert list(RoutingPolicy.objects.filter(is_active=True)) == [chosen]
    snapshot = live_snapshot(redis_conn, cp_keys)
    assert (snapshot.version, snapshot.policy.name) == (live.number, "chosen")
    assert node_named(snapshot, "eu-central-1").state == "draining"
