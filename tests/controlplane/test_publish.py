"""Publishing through the API puts a decodable snapshot in the real Redis, once per change."""

from __future__ import annotations

import pytest

from controlplane.connections import redis_client
from controlplane.fleet.models import Node
from controlplane.policies import publishing
from controlplane.policies.models import PolicyVersion, RoutingPolicy
from routing import contract
from routing.contract import GorgoParams, PolicyAnnouncement
from simulator.harness import free_port
from tests.controlplane.support import LLAMA, live_snapshot


@pytest.fixture
def policy(fleet) -> RoutingPolicy:
    return RoutingPolicy.objects.create(name="default", algorithm="gorgo", params={"w_rtt": 2.0})


def publish(client, policy: RoutingPolicy, **body):
    return client.post(f"/api/v1/policies/{policy.pk}/publish/", body, format="json")


def test_it_publishes_a_snapshot_the_gateways_can_decode(
    operator_client, policy, redis_conn, cp_keys
) -> None:
    response = publish(operator_client, policy, note="first")
    assert response.status_code == 201, response.content
    version = response.json()
    assert (version["number"], version["note"], version["author_name"]) == (1, "first", "op")
    assert version["policy"]["name"] == "default"

    snapshot = live_snapshot(redis_conn, cp_keys)
    assert snapshot is not None
    assert (snapshot.version, snapshot.checksum) == (1, version["checksum"])
    assert snapshot.schema_version == contract.SCHEMA_VERSION
    assert snapshot.policy.algorithm == "gorgo"
    assert snapshot.policy.params == GorgoParams(w_rtt=2.0)  # omitted params take their defaults
    assert {n.name for n in snapshot.nodes} == {
        "us-east-1",
        "us-east-2",
        "eu-central-1",
        "eu-central-2",
        "ap-south-1",
        "ap-south-2",
    }
    assert all(n.models == (LLAMA,) for n in snapshot.nodes)
    assert [r.slug for r in snapshot.regions] == ["ap-south", "eu-central", "us-east"]
    stored = PolicyVersion.objects.get(number=1)
    assert contract.decode(stored.snapshot, contract.PolicySnapshot) == snapshot
    policy.refresh_from_db()
    assert policy.is_active


def test_it_announces_the_new_version(operator_client, policy, redis_conn, cp_keys) -> None:
    pubsub = redis_conn.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(cp_keys.policy_channel)
    try:
        assert publish(operator_client, policy).status_code == 201
        message = None
        for _ in range(50):  # bounded: at most ~5 s
            message = pubsub.get_message(timeout=0.1)
            if message is not None:
                break
        assert message is not None, "no announcement on the policy channel"
        announcement = contract.decode(message["data"], PolicyAnnouncement)
        assert announcement.version == 1
        assert announcement.checksum == live_snapshot(redis_conn, cp_keys).checksum
    finally:
        pubsub.close()


def test_it_creates_no_version_when_nothing_changed(operator_client, policy, redis_conn, cp_keys) -> None:
    first = publish(operator_client, policy)
    second = publish(operator_client, policy, note="again")
    assert (first.status_code, second.status_code) == (201, 200)
    assert second.json()["number"] == first.json()["number"] == 1
    assert PolicyVersion.objects.count() == 1
    assert live_snapshot(redis_conn, cp_keys).version == 1


def test_it_creates_a_new_version_after_an_edit(operator_client, policy, redis_conn, cp_keys) -> None:
    assert publish(operator_client, policy).status_code == 201
    patched = operator_client.patch(
        f"/api/v1/policies/{policy.pk}/", {"params": {"w_rtt": 3.0}}, format="json"
    )
    assert patched.status_code == 200
    response = publish(operator_client, policy)
    assert response.status_code == 201
    assert response.json()["number"] == 2
    snapshot = live_snapshot(redis_conn, cp_keys)
    assert (snapshot.version, snapshot.policy.params.w_rtt) == (2, 3.0)


def test_it_publishes_only_what_was_reviewed(operator_client, policy, fleet, redis_conn, cp_keys) -> None:
    reviewed = operator_client.get(f"/api/v1/policies/{policy.pk}/diff/").json()["checksum"]
    fleet.nodes["us-east-1"].set_state("draining")  # the fleet changes after the review
    response = publish(operator_client, policy, checksum=reviewed)
    assert response.status_code == 409, response.content
    assert "review the diff again" in response.json()["detail"]
    assert not PolicyVersion.objects.exists()
    assert redis_conn.get(cp_keys.policy_current) is None
    reviewed = operator_client.post(f"/api/v1/policies/{policy.pk}/validate/").json()["checksum"]
    response = publish(operator_client, policy, checksum=reviewed)
    assert response.status_code == 201
    assert response.json()["checksum"] == reviewed


def test_it_publishes_only_what_was_reviewed_even_when_it_waited_for_another_publish(
    operator_client, policy, fleet, redis_conn, cp_keys, monkeypatch
) -> None:
    # The reviewed checksum was compared before the publish took its lock, and the snapshot was
    # compiled again once it had it: a node drained while it waited (another publish held the lock)
    # went live in a version nobody reviewed, answered 201 with a checksum other than the one sent.
    reviewed = operator_client.get(f"/api/v1/policies/{policy.pk}/diff/").json()["checksum"]
    waited = publishing.lock_publishes

    def drained_while_waiting() -> None:
        Node.objects.filter(pk=fleet.nodes["us-east-1"].pk).update(state="draining")
        waited()

    monkeypatch.setattr(publishing, "lock_publishes", drained_while_waiting)
    response = publish(operator_client, policy, checksum=reviewed)
    assert response.status_code == 409, response.content
    assert "review the diff again" in response.json()["detail"]
    assert not PolicyVersion.objects.exists()
    assert redis_conn.get(cp_keys.policy_current) is None


def test_it_heals_redis_when_it_lost_the_live_snapshot(operator_client, policy, redis_conn, cp_keys) -> None:
    assert publish(operator_client, policy).status_code == 201
    redis_conn.delete(cp_keys.policy_current)
    response = publish(operator_client, policy)
    assert response.status_code == 200
    assert live_snapshot(redis_conn, cp_keys).version == 1
    assert PolicyVersion.objects.count() == 1


def test_it_switches_the_active_policy(operator_client, policy, redis_conn, cp_keys) -> None:
    other = RoutingPolicy.objects.create(name="other", algorithm="least_load")
    assert publish(operator_client, policy).status_code == 201
    assert publish(operator_client, other).status_code == 201
    assert list(RoutingPolicy.objects.filter(is_active=True)) == [other]
    snapshot = live_snapshot(redis_conn, cp_keys)
    assert (snapshot.version, snapshot.policy.name, snapshot.policy.algorithm) == (2, "other", "least_load")


def test_it_refuses_an_invalid_policy_and_leaves_redis_untouched(
    operator_client, policy, redis_conn, cp_keys
) -> None:
    assert publish(operator_client, policy).status_code == 201
    before = redis_conn.get(cp_keys.policy_current)
    # Stored invalid behind validation's back (as after a manual database edit).
    RoutingPolicy.objects.filter(pk=policy.pk).update(params={"w_rtt": -1.0}, max_rtt_ms=-3)
    response = publish(operator_client, policy)
    assert response.status_code == 400, response.content
    assert set(response.json()) == {"params", "max_rtt_ms"}
    assert redis_conn.get(cp_keys.policy_current) == before
    assert PolicyVersion.objects.count() == 1


def test_it_never_writes_a_policy_that_was_always_invalid(
    operator_client, policy, redis_conn, cp_keys
) -> None:
    RoutingPolicy.objects.filter(pk=policy.pk).update(
        residency=[{"client_region": "mars", "node_regions": ["x"]}]
    )
    assert publish(operator_client, policy).status_code == 400
    assert redis_conn.get(cp_keys.policy_current) is None
    assert not PolicyVersion.objects.exists()
    policy.refresh_from_db()
    assert not policy.is_active


def test_it_answers_503_and_records_nothing_when_redis_is_unreachable(
    operator_client, policy, settings
) -> None:
    port = free_port()
    settings.REDIS_URL = f"redis://127.0.0.1:{port}/0"
    redis_client.cache_clear()
    response = publish(operator_client, policy)
    assert response.status_code == 503, response.content
    assert response.json()["code"] == "publish_failed"
    # Internal addresses stay in the log; the client learns what happened, not where.
    assert "127.0.0.1" not in response.json()["detail"] and str(port) not in response.json()["detail"]
    assert not PolicyVersion.objects.exists()
    policy.refresh_from_db()
    assert not policy.is_active


def test_it_lets_only_publishers_publish(viewer_client, anon_client, policy, redis_conn, cp_keys) -> None:
    assert publish(viewer_client, policy).status_code == 403
    assert publish(anon_client, policy).status_code == 401
    assert not PolicyVersion.objects.exists()
    assert redis_conn.get(cp_keys.policy_current) is None


def test_it_lists_versions_read_only(operator_client, viewer_client, policy) -> None:
    assert publish(operator_client, policy, note="one").status_code == 201
    listing = viewer_client.get("/api/v1/policy-versions/", {"policy": policy.pk})
    assert listing.status_code == 200
    [version] = listing.json()["results"]
    assert version["snapshot"]["version"] == 1
    detail = viewer_client.get(f"/api/v1/policy-versions/{version['id']}/")
    assert detail.json()["note"] == "one"
    assert operator_client.delete(f"/api/v1/policy-versions/{version['id']}/").status_code == 405
    assert operator_client.post("/api/v1/policy-versions/", {}, format="json").status_code == 405


def test_it_numbers_above_a_newer_snapshot_already_in_redis(
    operator_client, policy, redis_conn, cp_keys
) -> None:
    """After a database restore the gateways may run a version the database never saw: the next
    publish must go live above it, not be recorded and silently refused by the compare-and-set."""
    redis_conn.set(cp_keys.policy_current, b'{"schema_version": 1, "version": 41}')
    response = publish(operator_client, policy)
    assert response.status_code == 201, response.content
    assert response.json()["number"] == 42
    snapshot = live_snapshot(redis_conn, cp_keys)
    assert snapshot is not None and snapshot.version == 42


def test_an_edit_loaded_before_a_publish_never_writes_back_a_stale_active_flag(
    operator_client, policy, cp_keys
) -> None:
    """PATCH loads the row, a publish of another policy commits, PATCH saves: the flag is the
    publish's. Saving the whole row used to re-activate the edited policy (IntegrityError, 500)
    or, editing the one being activated, leave no policy active."""
    other = RoutingPolicy.objects.create(name="other", algorithm="least_load", params={})
    assert publish(operator_client, policy).status_code == 201
    stale_active = RoutingPolicy.objects.get(pk=policy.pk)
    stale_inactive = RoutingPolicy.objects.get(pk=other.pk)
    assert publish(operator_client, other).status_code == 201
    stale_active.description = "edited while the other was published"
    stale_active.full_clean()
    stale_active.save()
    stale_inactive.description = "edited too"
    stale_inactive.save()
    assert list(RoutingPolicy.objects.filter(is_active=True).values_list("pk", flat=True)) == [other.pk]
    assert RoutingPolicy.objects.get(pk=policy.pk).description == "edited while the other was published"
