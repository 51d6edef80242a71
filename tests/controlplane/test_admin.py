"""The Django admin: every model has pages; nodes drain/enable and policies publish from it."""

from __future__ import annotations

import pytest
from django.contrib.admin.models import LogEntry

from controlplane.policies.models import PolicyVersion, RoutingPolicy
from tests.controlplane.support import live_snapshot


@pytest.fixture
def admin_client_for_operator(client, operator):
    client.force_login(operator.user)
    return client


@pytest.mark.parametrize(
    "url",
    [
        "/admin/fleet/region/",
        "/admin/fleet/llmmodel/",
        "/admin/fleet/node/",
        "/admin/fleet/node/add/",
        "/admin/policies/routingpolicy/",
        "/admin/policies/routingpolicy/add/",
        "/admin/policies/policyversion/",
        "/admin/policies/policyexperiment/",
    ],
)
def test_it_shows_the_admin_pages_to_operators(admin_client_for_operator, fleet, url) -> None:
    assert admin_client_for_operator.get(url).status_code == 200


def test_it_drains_and_enables_nodes_with_admin_actions(admin_client_for_operator, fleet) -> None:
    nodes = [fleet.nodes["us-east-1"], fleet.nodes["us-east-2"]]
    selected = [n.pk for n in nodes]
    admin_client_for_operator.post("/admin/fleet/node/", {"action": "drain", "_selected_action": selected})
    assert {n.name: n.state for n in (n.__class__.objects.get(pk=n.pk) for n in nodes)} == {
        "us-east-1": "draining",
        "us-east-2": "draining",
    }
    admin_client_for_operator.post(
        "/admin/fleet/node/", {"action": "enable", "_selected_action": selected[:1]}
    )
    assert nodes[0].__class__.objects.get(pk=selected[0]).state == "active"
    history = LogEntry.objects.filter(object_id=str(selected[0])).order_by("action_time")
    assert [entry.change_message for entry in history] == [
        "state: draining (admin action)",
        "state: active (admin action)",
    ]
    assert {entry.user.username for entry in history} == {"op"}


def test_it_publishes_from_the_admin(admin_client_for_operator, fleet, redis_conn, cp_keys) -> None:
    policy = RoutingPolicy.objects.create(name="default")
    response = admin_client_for_operator.post(
        "/admin/policies/routingpolicy/", {"action": "publish", "_selected_action": [policy.pk]}, follow=True
    )
    assert "Published default v1" in response.content.decode()
    assert live_snapshot(redis_conn, cp_keys).version == 1
    version = PolicyVersion.objects.get()
    page = admin_client_for_operator.get(f"/admin/policies/policyversion/{version.pk}/change/")
    assert page.status_code == 200
    assert "schema_version" in page.content.decode()  # the snapshot, read-only


def test_it_keeps_version_history_read_only(admin_client_for_operator, fleet) -> None:
    policy = RoutingPolicy.objects.create(name="default")
    admin_client_for_operator.post(
        "/admin/policies/routingpolicy/", {"action": "publish", "_selected_action": [policy.pk]}
    )
    version = PolicyVersion.objects.get()
    assert admin_client_for_operator.get("/admin/policies/policyversion/add/").status_code == 403
    assert (
        admin_client_for_operator.get(f"/admin/policies/policyversion/{version.pk}/delete/").status_code
        == 403
    )
    admin_client_for_operator.post(
        f"/admin/policies/policyversion/{version.pk}/change/", {"note": "rewritten"}
    )
    version.refresh_from_db()
    assert version.note == ""


def test_it_refuses_admin_actions_to_viewers(client, viewer, fleet) -> None:
    client.force_login(viewer.user)
    node = fleet.nodes["us-east-1"]
    assert client.get("/admin/fleet/node/").status_code == 200
    client.post("/admin/fleet/node/", {"action": "drain", "_selected_action": [node.pk]})
    node.refresh_from_db()
    assert node.state == "active"
