"""Rolling back publishes an earlier version's policy settings again, as a new version."""

from __future__ import annotations

import threading

import pytest
from django.db import connection

from controlplane.policies import publishing
from controlplane.policies.models import PolicyVersion, RoutingPolicy
from tests.controlplane.support import client_for, live_snapshot


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


@pytest.mark.django_db(transaction=True)
def test_a_rollback_and_a_publish_of_another_policy_at_once_both_succeed(
    operator_client, operator, policy, monkeypatch, redis_conn, cp_keys
) -> None:
    """The rollback locked its policy's row and then waited for the publish lock; a publish of
    another policy held that lock and waited for the same row (to clear its active flag).
    PostgreSQL broke the deadlock after a second by failing one of them: 409 for an operator who
    had done nothing wrong. The rollback now takes the publish lock first, as every publish does."""
    if connection.vendor != "postgresql":
        pytest.skip("two connections writing at once: PostgreSQL")
    publish(operator_client, policy)
    operator_client.patch(f"/api/v1/policies/{policy.pk}/", {"params": {"w_rtt": 2.0}}, format="json")
    publish(operator_client, policy)
    other = RoutingPolicy.objects.create(name="other", algorithm="least_load", params={})
    first_lock, second_lock = threading.Event(), threading.Event()
    real_lock = publishing.lock_publishes
    roles: dict[int, str] = {}

    def lock_in_step() -> None:
        role = roles.get(threading.get_ident())
        if role == "rollback" and not first_lock.is_set():
            first_lock.set()  # the rollback is about to take the publish lock
            second_lock.wait(timeout=3)  # let the publish take it first, if it can
        elif role == "publish" and not second_lock.is_set():
            first_lock.wait(timeout=10)
            real_lock()
            second_lock.set()
            return
        real_lock()

    monkeypatch.setattr(publishing, "lock_publishes", lock_in_step)
    answers: dict[str, object] = {}

    def run(role: str, call) -> None:
        roles[threading.get_ident()] = role
        try:
            answers[role] = call()
        finally:
            first_lock.set()
            second_lock.set()
            connection.close()

    threads = [
        threading.Thread(target=run, args=("rollback", lambda: rollback(operator_client, policy, 1))),
        threading.Thread(
            target=run,
            args=(
                "publish",
                lambda: client_for(operator.token).post(f"/api/v1/policies/{other.pk}/publish/"),
            ),
        ),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert answers["rollback"].status_code == 201, answers["rollback"].content
    assert answers["publish"].status_code == 201, answers["publish"].content
    live = PolicyVersion.objects.order_by("-number").first()
    assert list(RoutingPolicy.objects.filter(is_active=True)) == [live.policy]
    assert live_snapshot(redis_conn, cp_keys).version == live.number
