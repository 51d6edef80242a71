"""Drain and enable from the nodes page: the state changes, who did it is recorded, the policy republishes."""

from __future__ import annotations

import pytest
import redis
from django.contrib.admin.models import LogEntry
from django.test import Client

from controlplane.fleet.choices import NodeStateChoices
from controlplane.policies.models import RoutingPolicy
from controlplane.policies.publishing import publish
from routing import contract
from routing.contract import PolicySnapshot, RedisKeys
from tests.dashboard.conftest import Fleet


@pytest.mark.django_db(transaction=True)
def test_it_drains_a_node_records_who_and_republishes(
    operator_client: Client,
    policy: RoutingPolicy,
    fleet: Fleet,
    operator,
    redis_conn: redis.Redis,
    cp_keys: RedisKeys,
) -> None:
    publish(policy, author=operator.user)
    node = fleet.nodes["eu-central-2"]
    response = operator_client.post(f"/nodes/{node.pk}/drain/", follow=True)
    assert [str(m) for m in response.context["messages"]] == ["eu-central-2 drained: state draining."]
    node.refresh_from_db()
    assert node.state == NodeStateChoices.DRAINING
    entry = LogEntry.objects.get()
    assert (entry.user, entry.object_repr) == (operator.user, "eu-central-2")
    assert entry.change_message == "state: active -> draining (dashboard)"
    assert "state: active -&gt; draining (dashboard)" in response.content.decode()  # listed on the page
    snapshot = contract.decode(redis_conn.get(cp_keys.policy_current), PolicySnapshot)
    assert snapshot.version == 2
    assert {n.name: n.state for n in snapshot.nodes}["eu-central-2"] == "draining"


@pytest.mark.django_db
def test_it_enables_a_drained_node(operator_client: Client, fleet: Fleet) -> None:
    node = fleet.nodes["ap-south-1"]
    node.set_state(NodeStateChoices.DRAINING)
    html = operator_client.get("/nodes/").content.decode()
    assert f'action="/nodes/{node.pk}/enable/"' in html
    assert "data-confirm=" in html  # the browser asks first
    operator_client.post(f"/nodes/{node.pk}/enable/")
    node.refresh_from_db()
    assert node.state == NodeStateChoices.ACTIVE
    assert LogEntry.objects.get().change_message == "state: draining -> active (dashboard)"


@pytest.mark.django_db
def test_it_records_nothing_when_the_node_already_had_that_state(
    operator_client: Client, fleet: Fleet
) -> None:
    node = fleet.nodes["us-east-1"]
    response = operator_client.post(f"/nodes/{node.pk}/enable/", follow=True)
    assert [str(m) for m in response.context["messages"]] == ["us-east-1 was already active."]
    assert not LogEntry.objects.exists()


@pytest.mark.django_db
def test_it_answers_404_for_an_unknown_node(operator_client: Client, fleet: Fleet) -> None:
    assert operator_client.post("/nodes/999999/drain/").status_code == 404


@pytest.mark.django_db
def test_it_only_accepts_post(operator_client: Client, fleet: Fleet) -> None:
    node = fleet.nodes["us-east-1"]
    assert operator_client.get(f"/nodes/{node.pk}/drain/").status_code == 405
