"""Rolling back publishes an earlier version's policy settings again, as a new version."""

from __future__ import annotations

import pytest

from controlplane.policies.models import PolicyVersion, RoutingPolicy
from tests.controlplane.support import live_snapshot


@pytest.fixture
def policy(fleet) -> RoutingPolicy:
    return RoutingPolicy.objects.create(name="default", algorithm="gorgo", params={"w_rtt": 1.0})


def publish(client, policy):
    response = client.post(f"/api/v1/policies/{policy.pk}/publish/")
    assert response.status_code == 201, response.content
    return response.json()


def rollback(client, policy, version: int):
    return client.post(f"/api/v1/policies/{policy.pk}/rollback/", {"version": version}, format="json")


def test_it_rolls_back_to_an_earlier_version(operator_client, policy, redis_conn, cp_keys) -> None:
    publish(operator_client, policy)
    operator_client.patch(
        f"/api/v1/policies/{policy.pk}/",
        {
            "params": {"w_rtt": 5.0},
            "residency": [{"client_region": "eu-central", "node_regions": ["eu-central"]}],
        },
        format="json",
    )
    publish(operator_client, policy)
    assert live_snapshot(redis_conn, cp_keys).policy.params.w_rtt == 5.0

    response = rollback(operator_client, policy, 1)
    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["number"], body["rolled_back_from"], body["author_name"]) == (3, 1, "op")
    snapshot = live_snapshot(redis_conn, cp_keys)
    assert (snapshot.version, snapshot.policy.params.w_rtt, snapshot.policy.residency) == (3, 1.0, ())
    assert snapshot.checksum == PolicyVersion.objects.get(number=1).checksum  # same fleet, same content
    shown = operator_client.get(f"/api/v1/policies/{policy.pk}/").json()
    assert (shown["params"]["w_rtt"], shown["residency"], shown["live_version"]) == (1.0, [], 3)


def test_it_reactivates_the_policy_of_the_version(operator_client, policy, redis_conn, cp_keys) -> None:
    publish(operator_client, policy)
    other = RoutingPolicy.objects.create(name="other", algorithm="round_robin")
    publish(operator_client, other)
    response = rollback(operator_client, policy, 1)
    assert response.status_code == 201
    assert list(RoutingPolicy.objects.filter(is_active=True)) == [policy]
    assert live_snapshot(redis_conn, cp_keys).policy.name == "default"


def test_it_changes_nothing_when_rolling_back_to_the_live_version(operator_client, policy) -> None:
    publish(operator_client, policy)
    response = rollback(operator_client, policy, 1)
    assert response.status_code == 200
    assert response.json()["number"] == 1
    assert PolicyVersion.objects.count() == 1


def test_it_refuses_a_version_of_another_policy(operator_client, policy, redis_conn, cp_keys) -> None:
    other = RoutingPolicy.objects.create(name="other", algorithm="round_robin")
    publish(operator_client, other)
    publish(operator_client, policy)
    response = rollback(operator_client, policy, 1)
    assert response.status_code == 404  # well-formed, but no such version of this policy
    assert "not a version of policy default" in response.json()["detail"]
    assert rollback(operator_client, policy, 99).status_code == 404
    assert rollback(operator_client, policy, "latest").status_code == 400
    assert live_snapshot(redis_conn, cp_keys).version == 2


def test_it_lets_only_publishers_roll_back(operator_client, viewer_client, policy) -> None:
    publish(operator_client, policy)
    operator_client.patch(f"/api/v1/policies/{policy.pk}/", {"params": {"w_rtt": 5.0}}, format="json")
    publish(operator_client, policy)
    assert rollback(viewer_client, policy, 1).status_code == 403
    assert PolicyVersion.objects.count() == 2
