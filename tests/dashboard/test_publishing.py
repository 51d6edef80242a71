"""Publishing from the browser: the reviewed diff, then publish or roll back, against real Redis."""

from __future__ import annotations

import pytest
import redis
from django.test import Client

from controlplane.connections import redis_client
from controlplane.fleet.models import Node
from controlplane.policies import publishing
from controlplane.policies.models import PolicyVersion, RoutingPolicy
from controlplane.policies.publishing import compile_policy, publish
from routing import contract
from routing.contract import PolicySnapshot, RedisKeys
from simulator.harness import free_port


def live_snapshot(conn: redis.Redis, keys: RedisKeys) -> PolicySnapshot | None:
    raw = conn.get(keys.policy_current)
    return None if raw is None else contract.decode(raw, PolicySnapshot)


def messages_of(response) -> list[str]:
    return [str(m) for m in response.context["messages"]]


@pytest.mark.django_db
def test_it_shows_the_diff_against_the_live_version(
    operator_client: Client, policy: RoutingPolicy, operator
) -> None:
    publish(policy, author=operator.user)
    policy.params = {"w_rtt": 3.0}
    policy.max_rtt_ms = 250.0
    policy.save()
    response = operator_client.get(f"/policies/{policy.pk}/")
    changes = {c.path: (c.old, c.new) for c in response.context["review"]["changes"]}
    assert changes == {"policy.params.w_rtt": (1.0, 3.0), "policy.max_rtt_ms": (None, 250.0)}
    html = response.content.decode()
    assert "2 changes against live v1" in html
    assert "policy.params.w_rtt" in html


@pytest.mark.django_db
def test_it_publishes_the_reviewed_snapshot_with_its_author(
    operator_client: Client, policy: RoutingPolicy, operator, redis_conn: redis.Redis, cp_keys: RedisKeys
) -> None:
    checksum = compile_policy(policy).checksum
    response = operator_client.post(
        f"/policies/{policy.pk}/publish/", {"checksum": checksum, "note": "first light"}, follow=True
    )
    version = PolicyVersion.objects.get()
    assert (version.number, version.author, version.note) == (1, operator.user, "first light")
    assert messages_of(response) == ["Published version 1; the gateways switch to it now."]
    snapshot = live_snapshot(redis_conn, cp_keys)
    assert snapshot is not None and (snapshot.version, snapshot.checksum) == (1, checksum)
    assert 'id="publish-button" disabled' in response.content.decode()  # now live: nothing to publish


@pytest.mark.django_db
def test_it_refuses_a_fleet_change_that_lands_while_the_publish_waits(
    operator_client: Client, policy: RoutingPolicy, redis_conn: redis.Redis, cp_keys: RedisKeys, monkeypatch
) -> None:
    # Compared before the publish took its lock, the checksum let a node drained meanwhile go live
    # in a version nobody reviewed ("Published version 1").
    reviewed = compile_policy(policy).checksum
    waited = publishing.lock_publishes

    def drained_while_waiting() -> None:
        Node.objects.filter(pk=Node.objects.order_by("pk").first().pk).update(state="draining")
        waited()

    monkeypatch.setattr(publishing, "lock_publishes", drained_while_waiting)
    response = operator_client.post(f"/policies/{policy.pk}/publish/", {"checksum": reviewed}, follow=True)
    assert messages_of(response) == [
        "Not published, nothing changed: The policy or the fleet changed since that checksum; "
        "review the diff again."
    ]
    assert not PolicyVersion.objects.exists()
    assert live_snapshot(redis_conn, cp_keys) is None


@pytest.mark.django_db
def test_it_refuses_to_publish_when_the_policy_changed_after_review(
    operator_client: Client, policy: RoutingPolicy, redis_conn: redis.Redis, cp_keys: RedisKeys
) -> None:
    reviewed = compile_policy(policy).checksum
    RoutingPolicy.objects.filter(pk=policy.pk).update(params={"w_rtt": 9.0})
    response = operator_client.post(f"/policies/{policy.pk}/publish/", {"checksum": reviewed}, follow=True)
    assert messages_of(response) == [
        "The policy or the fleet changed after you reviewed the diff. Review it again."
    ]
    assert not PolicyVersion.objects.exists()
    assert live_snapshot(redis_conn, cp_keys) is None


@pytest.mark.django_db
def test_it_reports_an_unreachable_redis_and_records_nothing(
    operator_client: Client, policy: RoutingPolicy, settings
) -> None:
    checksum = compile_policy(policy).checksum
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"
    redis_client.cache_clear()
    response = operator_client.post(f"/policies/{policy.pk}/publish/", {"checksum": checksum}, follow=True)
    assert messages_of(response)[0].startswith(
        "Not published, nothing changed: The policy store is unreachable"
    )
    assert "127.0.0.1" not in messages_of(response)[0]
    assert not PolicyVersion.objects.exists()


@pytest.mark.django_db
def test_it_says_so_when_the_policy_is_already_live(
    operator_client: Client, policy: RoutingPolicy, operator
) -> None:
    publish(policy, author=operator.user)
    checksum = compile_policy(policy).checksum
    response = operator_client.post(f"/policies/{policy.pk}/publish/", {"checksum": checksum}, follow=True)
    assert messages_of(response) == ["No changes: version 1 is already live."]
    assert PolicyVersion.objects.count() == 1


@pytest.mark.django_db
def test_it_rolls_back_to_an_earlier_version(
    operator_client: Client, policy: RoutingPolicy, operator, redis_conn: redis.Redis, cp_keys: RedisKeys
) -> None:
    publish(policy, author=operator.user)
    policy.params = {"w_rtt": 5.0}
    policy.save()
    publish(policy, author=operator.user)
    response = operator_client.post(f"/policies/{policy.pk}/rollback/", {"version": 1}, follow=True)
    assert messages_of(response) == ["Published version 3; the gateways switch to it now."]
    v3 = PolicyVersion.objects.get(number=3)
    assert (v3.rolled_back_from.number, v3.author, v3.note) == (1, operator.user, "rollback to v1")
    assert live_snapshot(redis_conn, cp_keys).policy.params.w_rtt == 1.0


@pytest.mark.django_db
def test_it_refuses_to_roll_back_to_another_policys_version(
    operator_client: Client, policy: RoutingPolicy, operator
) -> None:
    other = RoutingPolicy.objects.create(name="other", algorithm="round_robin")
    publish(other, author=operator.user)
    response = operator_client.post(f"/policies/{policy.pk}/rollback/", {"version": 1}, follow=True)
    assert messages_of(response) == ["That version does not belong to this policy."]
    assert PolicyVersion.objects.count() == 1


@pytest.mark.django_db
def test_it_explains_why_an_invalid_policy_cannot_be_published(
    operator_client: Client, policy: RoutingPolicy
) -> None:
    RoutingPolicy.objects.filter(pk=policy.pk).update(max_rtt_ms=-1)
    html = operator_client.get(f"/policies/{policy.pk}/").content.decode()
    assert "This policy cannot be published" in html
    assert "max_rtt_ms: Maximum RTT must be between 0 and 10000 ms." in html
    assert 'id="publish-button"' not in html
