from __future__ import annotations

import pytest

from controlplane.fleet.api.serializers import NodeSerializer
from controlplane.fleet.models import Node
from controlplane.policies.models import RoutingPolicy
from tests.controlplane.crud import CRUDTests
from tests.controlplane.support import LLAMA, client_for, edit_racing, live_snapshot


class TestNodeAPI(CRUDTests):
    url = "/api/v1/nodes/"
    model = Node
    create_data = {
        "name": "eu-central-9",
        "region": "eu-central",
        "base_url": "http://127.0.0.1:9300",
        "models": [LLAMA],
        "gpu_type": "A100-80GB",
        "gpu_count": 2,
        "max_num_seqs": 128,
        "prefill_tokens_per_s": 15000.0,
        "kv_capacity_tokens": 200000,
        "state": "active",
        "labels": {"rack": "a1"},
    }
    update_data = {"region": "ap-south", "state": "draining", "models": [], "gpu_count": 4, "labels": {}}

    def make(self, index: int) -> Node:
        # Disabled: an active node may not be deleted (test_deletion.py), the generic delete test would 409.
        node = Node.objects.create(
            name=f"node-{index}",
            region=self.regions["us-east"],
            base_url=f"http://127.0.0.1:{9200 + index}",
            state="disabled",
        )
        node.served_models.add(self.llm)
        return node

    def test_it_filters_by_region_state_and_model(self, viewer_client, fleet) -> None:
        fleet.nodes["us-east-2"].set_state("draining")
        response = viewer_client.get(self.url, {"region": "us-east", "state": "active", "model": LLAMA})
        assert [n["name"] for n in response.json()["results"]] == ["us-east-1"]

    def test_it_strips_a_trailing_slash_from_the_base_url(self, operator_client) -> None:
        data = {**self.create_data, "base_url": "http://127.0.0.1:9300/"}
        response = operator_client.post(self.url, data, format="json")
        assert response.status_code == 201, response.content
        assert response.json()["base_url"] == "http://127.0.0.1:9300"
        assert Node.objects.get(name="eu-central-9").base_url == "http://127.0.0.1:9300"


class TestNodeActions:
    def test_it_drains_and_enables_a_node(self, operator_client, fleet) -> None:
        node = fleet.nodes["eu-central-1"]
        response = operator_client.post(f"/api/v1/nodes/{node.pk}/drain/")
        assert response.status_code == 200, response.content
        assert response.json()["state"] == "draining"
        node.refresh_from_db()
        assert node.state == "draining"
        response = operator_client.post(f"/api/v1/nodes/{node.pk}/enable/")
        assert response.status_code == 200
        assert response.json()["state"] == "active"
        node.refresh_from_db()
        assert node.state == "active"

    def test_it_refuses_drain_to_viewers_and_anonymous_users(self, viewer_client, anon_client, fleet) -> None:
        node = fleet.nodes["eu-central-1"]
        assert viewer_client.post(f"/api/v1/nodes/{node.pk}/drain/").status_code == 403
        assert anon_client.post(f"/api/v1/nodes/{node.pk}/drain/").status_code == 401
        node.refresh_from_db()
        assert node.state == "active"


@pytest.mark.django_db(transaction=True)
def test_an_edit_never_puts_back_in_rotation_a_node_drained_meanwhile(
    operator_client, operator, fleet, monkeypatch, redis_conn, cp_keys
) -> None:
    """One operator raises a node's GPU count while another drains it. The edit saved the whole
    row as it had loaded it, state ``active`` included: the drain was undone without a word and
    the republish sent the node traffic again. An edit now locks the row before it reads it."""
    policy = RoutingPolicy.objects.create(name="default", algorithm="gorgo")
    assert operator_client.post(f"/api/v1/policies/{policy.pk}/publish/").status_code == 201
    node = fleet.nodes["eu-central-1"]
    edited, drained = edit_racing(
        monkeypatch,
        NodeSerializer,
        lambda: operator_client.patch(f"/api/v1/nodes/{node.pk}/", {"gpu_count": 4}, format="json"),
        lambda: client_for(operator.token).post(f"/api/v1/nodes/{node.pk}/drain/"),
    )
    assert (edited.status_code, drained.status_code) == (200, 200), (edited.content, drained.content)
    node.refresh_from_db()
    assert (node.gpu_count, node.state) == (4, "draining")
    live = next(n for n in live_snapshot(redis_conn, cp_keys).nodes if n.name == node.name)
    assert (live.gpu_count, live.state) == (4, "draining")
