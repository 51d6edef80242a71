"""Viewers see everything and change nothing; operators get the buttons and may use them."""

from __future__ import annotations

import pytest
from django.test import Client

from controlplane.fleet.choices import NodeStateChoices
from controlplane.policies.models import PolicyVersion, RoutingPolicy
from controlplane.policies.publishing import compile_policy, publish
from tests.dashboard.conftest import Fleet


@pytest.mark.django_db
def test_it_shows_a_viewer_no_publish_edit_or_drain_buttons(
    viewer_client: Client, policy: RoutingPolicy
) -> None:
    detail = viewer_client.get(f"/policies/{policy.pk}/").content.decode()
    assert 'id="publish-button"' not in detail
    assert 'id="edit-policy"' not in detail
    assert "Only operators can publish." in detail
    assert ">Drain</button>" not in viewer_client.get("/nodes/").content.decode()
    assert "New policy" not in viewer_client.get("/policies/").content.decode()


@pytest.mark.django_db
def test_it_shows_an_operator_the_buttons(operator_client: Client, policy: RoutingPolicy) -> None:
    detail = operator_client.get(f"/policies/{policy.pk}/").content.decode()
    assert 'id="publish-button"' in detail
    assert 'id="edit-policy"' in detail
    assert detail.count(">Drain</button>") == 0  # the policy page has no node actions
    assert operator_client.get("/nodes/").content.decode().count(">Drain</button>") == 6


@pytest.mark.django_db
def test_it_forbids_a_viewer_to_publish(viewer_client: Client, policy: RoutingPolicy) -> None:
    checksum = compile_policy(policy).checksum
    response = viewer_client.post(f"/policies/{policy.pk}/publish/", {"checksum": checksum})
    assert response.status_code == 403
    assert not PolicyVersion.objects.exists()


@pytest.mark.django_db
def test_it_forbids_a_viewer_to_roll_back(viewer_client: Client, policy: RoutingPolicy, operator) -> None:
    publish(policy, author=operator.user)
    response = viewer_client.post(f"/policies/{policy.pk}/rollback/", {"version": 1})
    assert response.status_code == 403
    assert PolicyVersion.objects.count() == 1


@pytest.mark.django_db
def test_it_forbids_a_viewer_to_edit_or_create_policies(viewer_client: Client, policy: RoutingPolicy) -> None:
    assert viewer_client.get(f"/policies/{policy.pk}/edit/").status_code == 403
    assert viewer_client.get("/policies/new/").status_code == 403
    response = viewer_client.post(
        f"/policies/{policy.pk}/edit/", {"name": "renamed", "algorithm": "round_robin"}
    )
    assert response.status_code == 403
    policy.refresh_from_db()
    assert (policy.name, policy.algorithm) == ("default", "gorgo")


@pytest.mark.django_db
@pytest.mark.parametrize("action", ["drain", "enable"])
def test_it_forbids_a_viewer_to_drain_or_enable_nodes(
    viewer_client: Client, fleet: Fleet, action: str
) -> None:
    node = fleet.nodes["us-east-1"]
    node.set_state(NodeStateChoices.DISABLED)
    response = viewer_client.post(f"/nodes/{node.pk}/{action}/")
    assert response.status_code == 403
    node.refresh_from_db()
    assert node.state == NodeStateChoices.DISABLED


@pytest.mark.django_db
def test_it_redirects_anonymous_actions_to_login(client: Client, policy: RoutingPolicy, fleet: Fleet) -> None:
    node = fleet.nodes["us-east-1"]
    for url in (
        f"/nodes/{node.pk}/drain/",
        f"/policies/{policy.pk}/publish/",
        f"/policies/{policy.pk}/rollback/",
    ):
        response = client.post(url)
        assert response.status_code == 302
        assert response["Location"].startswith("/login/")
    node.refresh_from_db()
    assert node.state == NodeStateChoices.ACTIVE


@pytest.mark.django_db
def test_it_refuses_anonymous_chart_data(client: Client) -> None:
    response = client.get("/data/overview/")
    assert response.status_code == 403
    assert response.json() == {"detail": "Sign in first."}
