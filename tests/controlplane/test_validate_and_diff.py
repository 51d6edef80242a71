"""The dry run (validate) and the diff against the live snapshot: they answer, and write nothing."""

from __future__ import annotations

import pytest

from controlplane.policies.models import PolicyVersion, RoutingPolicy


@pytest.fixture
def policy(fleet) -> RoutingPolicy:
    return RoutingPolicy.objects.create(name="default", algorithm="gorgo", params={"w_rtt": 1.0})


def test_it_validates_without_publishing(viewer_client, policy, redis_conn, cp_keys) -> None:
    response = viewer_client.post(f"/api/v1/policies/{policy.pk}/validate/")
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["valid"] is True
    assert (body["live_version"], body["differs_from_live"]) == (None, True)
    assert len(body["checksum"]) == 64
    summary = body["summary"]
    assert summary["algorithm"] == "gorgo"
    assert summary["params"] == {
        "w_rtt": 1.0,
        "w_queue": 1.0,
        "default_rtt_ms": 100.0,
        "chars_per_token": 4.0,
        "w_displacement": 1.0,
        "homing_rent_ratio": 5.0,
        "measured_inputs": True,
    }
    assert summary["nodes"] == {"total": 6, "active": 6, "draining": 0, "disabled": 0}
    assert len(summary["routable_nodes"]) == 6
    assert not PolicyVersion.objects.exists()
    assert redis_conn.get(cp_keys.policy_current) is None
    policy.refresh_from_db()
    assert not policy.is_active


def test_it_says_whether_the_policy_differs_from_live(operator_client, policy, fleet) -> None:
    published = operator_client.post(f"/api/v1/policies/{policy.pk}/publish/").json()
    body = operator_client.post(f"/api/v1/policies/{policy.pk}/validate/").json()
    assert (body["differs_from_live"], body["live_version"], body["checksum"]) == (
        False,
        1,
        published["checksum"],
    )
    fleet.nodes["us-east-1"].set_state("draining")  # no on_commit in this test: nothing republished
    body = operator_client.post(f"/api/v1/policies/{policy.pk}/validate/").json()
    assert body["differs_from_live"] is True
    assert body["summary"]["nodes"]["draining"] == 1
    assert "us-east-1" not in body["summary"]["routable_nodes"]


def test_it_reports_errors_of_an_invalid_policy(operator_client, policy) -> None:
    RoutingPolicy.objects.filter(pk=policy.pk).update(params={"w_rtt": "heavy"})
    response = operator_client.post(f"/api/v1/policies/{policy.pk}/validate/")
    assert response.status_code == 400
    assert "w_rtt" in " ".join(response.json()["params"])
    assert operator_client.get(f"/api/v1/policies/{policy.pk}/diff/").status_code == 400


def test_it_diffs_against_the_live_snapshot(operator_client, viewer_client, policy, fleet) -> None:
    assert operator_client.post(f"/api/v1/policies/{policy.pk}/publish/").status_code == 201
    unchanged = viewer_client.get(f"/api/v1/policies/{policy.pk}/diff/").json()
    assert (unchanged["changed"], unchanged["changes"], unchanged["live_version"]) == (False, [], 1)

    operator_client.patch(f"/api/v1/policies/{policy.pk}/", {"params": {"w_rtt": 2.5}}, format="json")
    fleet.nodes["us-east-1"].set_state("draining")
    fleet.nodes["ap-south-2"].delete()
    response = viewer_client.get(f"/api/v1/policies/{policy.pk}/diff/")
    assert response.status_code == 200
    body = response.json()
    assert body["changed"] is True
    assert body["live_policy"] == "default"
    assert body["checksum"] != body["live_checksum"]
    changes = {c["path"]: (c["old"], c["new"]) for c in body["changes"]}
    assert changes["policy.params.w_rtt"] == (1.0, 2.5)
    assert changes["nodes[us-east-1].state"] == ("active", "draining")
    old_node, new_node = changes["nodes[ap-south-2]"]
    assert (old_node["base_url"], new_node) == ("http://127.0.0.1:9106", None)
    assert len(changes) == 3
    assert PolicyVersion.objects.count() == 1


def test_it_diffs_against_nothing_before_the_first_publish(viewer_client, policy) -> None:
    body = viewer_client.get(f"/api/v1/policies/{policy.pk}/diff/").json()
    assert body["live_version"] is None
    paths = {c["path"] for c in body["changes"]}
    assert {"policy", "regions", "models", "nodes", "schema_version"} == paths
