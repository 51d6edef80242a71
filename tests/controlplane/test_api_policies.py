from __future__ import annotations

from controlplane.policies.models import RoutingPolicy
from tests.controlplane.crud import CRUDTests
from tests.controlplane.support import LLAMA


class TestPolicyAPI(CRUDTests):
    url = "/api/v1/policies/"
    model = RoutingPolicy
    create_data = {
        "name": "eu-residency",
        "description": "EU clients stay in the EU.",
        "algorithm": "gorgo",
        "params": {"w_rtt": 2.0, "w_queue": 0.5},
        "model_scope": [LLAMA],
        "residency": [{"client_region": "eu-central", "node_regions": ["eu-central"]}],
        "max_rtt_ms": 150.0,
    }
    update_data = {
        "algorithm": "prefix_affinity",
        "params": {"cache_threshold": 0.5},
        "model_scope": [],
        "residency": [],
        "max_rtt_ms": None,
    }

    def make(self, index: int) -> RoutingPolicy:
        policy = RoutingPolicy.objects.create(name=f"policy-{index}", algorithm="least_load")
        policy.model_scope.add(self.llm)
        return policy

    def test_it_shows_the_active_policy_and_its_live_version(self, operator_client, fleet) -> None:
        policy = self.make(1)
        assert operator_client.post(f"{self.url}{policy.pk}/publish/").status_code == 201
        body = operator_client.get(self.detail(policy)).json()
        assert body["is_active"] is True
        assert body["live_version"] == 1
        other = self.make(2)
        assert operator_client.get(self.detail(other)).json()["live_version"] is None

    def test_it_refuses_is_active_in_writes(self, operator_client) -> None:
        # Publishing is the one way to activate: a write naming is_active says so, writes nothing.
        response = operator_client.post(self.url, {**self.create_data, "is_active": True}, format="json")
        assert response.status_code == 400
        assert list(response.json()) == ["is_active"]
        assert not RoutingPolicy.objects.filter(name="eu-residency").exists()
