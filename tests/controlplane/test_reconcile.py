"""The periodic reconcile publishes what a failed fleet-change republish missed."""

from __future__ import annotations

import pytest

from controlplane.connections import redis_client
from controlplane.fleet.models import Node
from controlplane.policies import publishing
from controlplane.policies.models import PolicyVersion, RoutingPolicy
from controlplane.policies.tasks import reconcile
from routing import contract
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
    assert reconcile() == {}  # still unreachable: nothing recorded

    settings.REDIS_URL = redis_url
    redis_client.cache_clear()
    assert reconciled_version() == 2
    snapshot = live_snapshot(redis_conn, cp_keys)
    assert snapshot is not None and snapshot.version == 2
    assert {n.name: n.state for n in snapshot.nodes}["us-east-1"] == "draining"
    assert reconciled_version() == 2  # nothing changed since: no new version


def test_it_does_nothing_without_an_active_policy(fleet) -> None:
    assert reconcile()["policy"] is None
    assert PolicyVersion.objects.count() == 0


def reconciled_version() -> int | None:
    """Run the reconcile; the live version number afterwards."""
    reconcile()
    live = publishing.live_version()
    return live.number if live is not None else None


def unreachable_redis(settings) -> None:
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    publishing.redis_client.cache_clear()


def reachable_redis(settings, redis_url: str) -> None:
    settings.REDIS_URL = redis_url
    publishing.redis_client.cache_clear()


def test_it_never_publishes_an_edit_nobody_published(operator_client, fleet, redis_conn, cp_keys) -> None:
    policy = RoutingPolicy.objects.create(name="default", algorithm="gorgo")
    assert operator_client.post(f"/api/v1/policies/{policy.pk}/publish/").status_code == 201
    response = operator_client.patch(
        f"/api/v1/policies/{policy.pk}/", {"params": {"w_rtt": 1.25}}, format="json"
    )
    assert response.status_code == 200
    assert reconciled_version() == 1  # nothing to do: the edit waits for a publish
    assert PolicyVersion.objects.count() == 1
    assert live_snapshot(redis_conn, cp_keys).policy.params.w_rtt == 1.0


def test_a_publish_refused_while_redis_was_down_never_goes_live_later(
    operator_client, fleet, redis_conn, redis_url, cp_keys, settings
) -> None:
    policy = RoutingPolicy.objects.create(name="default", algorithm="gorgo")
    assert operator_client.post(f"/api/v1/policies/{policy.pk}/publish/").status_code == 201
    unreachable_redis(settings)
    assert (
        operator_client.patch(
            f"/api/v1/policies/{policy.pk}/", {"params": {"w_rtt": 1.25}}, format="json"
        ).status_code
        == 200
    )
    assert operator_client.post(f"/api/v1/policies/{policy.pk}/publish/").status_code == 503
    Node.objects.filter(name="us-east-1").update(state="draining")  # and the fleet changed meanwhile
    reachable_redis(settings, redis_url)

    assert reconciled_version() == 2  # the fleet change goes out ...
    snapshot = live_snapshot(redis_conn, cp_keys)
    assert {n.name: n.state for n in snapshot.nodes}["us-east-1"] == "draining"
    assert snapshot.policy.params.w_rtt == 1.0  # ... with the settings last published
    version = PolicyVersion.objects.get(number=2)
    assert (version.author_name, version.note.startswith("reconcile")) == ("system", True)


def test_a_fleet_change_republishes_the_published_settings_not_the_edited_row(
    operator_client, fleet, redis_conn, cp_keys
) -> None:
    policy = RoutingPolicy.objects.create(name="default", algorithm="gorgo")
    assert operator_client.post(f"/api/v1/policies/{policy.pk}/publish/").status_code == 201
    operator_client.patch(f"/api/v1/policies/{policy.pk}/", {"params": {"w_rtt": 1.25}}, format="json")
    node = fleet.nodes["us-east-1"]
    assert operator_client.post(f"/api/v1/nodes/{node.pk}/drain/").status_code == 200
    snapshot = live_snapshot(redis_conn, cp_keys)
    assert (snapshot.version, snapshot.policy.params.w_rtt) == (2, 1.0)


def test_an_empty_redis_gets_the_policy_and_the_key_set_back(fleet, redis_conn, cp_keys) -> None:
    """Redis restarted empty: one pass writes back everything the gateways read from it."""
    from controlplane.keys.models import ClientKey
    from routing.contract import ClientKeySet
    from tests.conftest import delete_namespace

    policy = RoutingPolicy.objects.create(name="default", algorithm="least_load")
    publishing.publish(policy)
    ClientKey.objects.create(key_id="k1", secret_sha256="0" * 64, owner="o", name="one")
    assert redis_conn.exists(cp_keys.key_set, cp_keys.policy_current) == 2
    delete_namespace(redis_conn, cp_keys.prefix)

    done = reconcile()
    assert done == {"policy": "wrote back version 1", "client keys": "wrote 1 key(s) (lost in Redis)"}
    assert live_snapshot(redis_conn, cp_keys).version == 1
    key_set = contract.decode(redis_conn.get(cp_keys.key_set), ClientKeySet)
    assert [k.id for k in key_set.keys] == ["k1"]
    assert reconcile() == {"policy": None, "client keys": None}  # all in place: nothing written


def test_a_key_change_redis_missed_goes_out_with_the_next_pass(
    fleet, redis_conn, cp_keys, settings, redis_url
) -> None:
    from controlplane.keys.models import ClientKey
    from controlplane.keys.publishing import publish_keys
    from routing.contract import ClientKeySet

    key = ClientKey.objects.create(key_id="k1", secret_sha256="0" * 64, owner="o", name="one")
    publish_keys()
    unreachable_redis(settings)
    key.revoked = True
    key.save()  # the on-commit publish fails quietly; the database keeps the revocation
    reachable_redis(settings, redis_url)
    assert reconcile()["client keys"] == "wrote 1 key(s) (out of date in Redis)"
    assert contract.decode(redis_conn.get(cp_keys.key_set), ClientKeySet).keys[0].revoked is True
