"""Deleting what routing still uses is refused with 409 and the reason, in the API and the admin."""

from __future__ import annotations

from django.utils import timezone

from controlplane.fleet.models import LLMModel, Node, Region
from controlplane.policies.models import RoutingPolicy
from telemetry.models import HealthEvent, MetricSample, RequestAggregate, RTTSample


def assert_conflict(response, *words: str) -> None:
    assert response.status_code == 409, response.content
    detail = response.json()["detail"]
    for word in words:
        assert word in detail


def test_it_refuses_to_delete_the_active_policy(operator_client, fleet) -> None:
    policy = RoutingPolicy.objects.create(name="default")
    assert operator_client.post(f"/api/v1/policies/{policy.pk}/publish/").status_code == 201
    assert_conflict(operator_client.delete(f"/api/v1/policies/{policy.pk}/"), "active policy")
    assert RoutingPolicy.objects.filter(pk=policy.pk).exists()


def test_it_refuses_to_delete_a_policy_with_history(operator_client, fleet) -> None:
    old = RoutingPolicy.objects.create(name="old")
    new = RoutingPolicy.objects.create(name="new")
    assert operator_client.post(f"/api/v1/policies/{old.pk}/publish/").status_code == 201
    assert operator_client.post(f"/api/v1/policies/{new.pk}/publish/").status_code == 201
    assert_conflict(operator_client.delete(f"/api/v1/policies/{old.pk}/"), "1 published version")


def test_it_refuses_to_delete_a_region_with_nodes(operator_client, fleet) -> None:
    region = fleet.regions["us-east"]
    assert_conflict(operator_client.delete(f"/api/v1/regions/{region.pk}/"), "us-east-1", "us-east-2")
    assert Region.objects.filter(pk=region.pk).exists()


def test_it_refuses_to_delete_a_region_named_in_residency_rules(operator_client, fleet) -> None:
    region = Region.objects.create(slug="eu-west", name="Dublin", latitude=53.35, longitude=-6.26)
    RoutingPolicy.objects.create(
        name="eu", residency=[{"client_region": "eu-central", "node_regions": ["eu-central", "eu-west"]}]
    )
    assert_conflict(operator_client.delete(f"/api/v1/regions/{region.pk}/"), "residency", "eu")
    assert Region.objects.filter(pk=region.pk).exists()


def test_it_refuses_to_delete_a_served_model(operator_client, fleet) -> None:
    assert_conflict(operator_client.delete(f"/api/v1/models/{fleet.model.pk}/"), "served by", "us-east-1")
    assert LLMModel.objects.filter(pk=fleet.model.pk).exists()


def test_it_refuses_to_delete_a_model_in_a_policy_scope(operator_client, fleet) -> None:
    model = LLMModel.objects.create(name="org/unserved")
    RoutingPolicy.objects.create(name="scoped").model_scope.add(model)
    assert_conflict(operator_client.delete(f"/api/v1/models/{model.pk}/"), "model scope of scoped")


def test_it_shows_the_same_reasons_in_the_admin(client, operator, fleet) -> None:
    client.force_login(operator.user)
    region = fleet.regions["us-east"]
    page = client.get(f"/admin/fleet/region/{region.pk}/delete/")
    assert page.status_code == 200
    assert "still has nodes" in page.content.decode()
    response = client.post(f"/admin/fleet/region/{region.pk}/delete/", {"post": "yes"})
    assert response.status_code in (200, 403)
    assert Region.objects.filter(pk=region.pk).exists()
    model = fleet.model
    bulk = client.post(
        "/admin/fleet/llmmodel/", {"action": "delete_selected", "_selected_action": [model.pk], "post": "yes"}
    )
    assert bulk.status_code == 200
    assert LLMModel.objects.filter(pk=model.pk).exists()


def test_it_refuses_to_delete_an_active_node_and_says_to_drain_it_first(operator_client, fleet) -> None:
    node = fleet.nodes["us-east-1"]
    assert_conflict(
        operator_client.delete(f"/api/v1/nodes/{node.pk}/"), "us-east-1 is active", "Drain it first"
    )
    assert Node.objects.filter(pk=node.pk).exists()


def test_it_deletes_a_drained_node(operator_client, fleet) -> None:
    node = fleet.nodes["us-east-1"]
    assert operator_client.post(f"/api/v1/nodes/{node.pk}/drain/").status_code == 200
    assert operator_client.delete(f"/api/v1/nodes/{node.pk}/").status_code == 204
    assert not Node.objects.filter(pk=node.pk).exists()


def test_the_admin_refuses_to_delete_an_active_node(client, operator, fleet) -> None:
    client.force_login(operator.user)
    node = fleet.nodes["ap-south-2"]
    page = client.get(f"/admin/fleet/node/{node.pk}/delete/")
    assert "Drain it first" in page.content.decode()
    client.post(f"/admin/fleet/node/{node.pk}/delete/", {"post": "yes"})
    assert Node.objects.filter(pk=node.pk).exists()


def test_deleting_nodes_and_a_region_keeps_their_telemetry_history(operator_client, fleet) -> None:
    now = timezone.now()
    region, node = fleet.regions["ap-south"], fleet.nodes["ap-south-1"]
    RTTSample.objects.create(region=region, node=node, ts=now, ok=True, rtt_ms=1.5)
    MetricSample.objects.create(node=node, ts=now, ok=True)
    HealthEvent.objects.create(node=node, ts=now, previous="unknown", current="healthy", source="probe")
    RequestAggregate.objects.create(resolution="10s", scope="node", node=node, bucket_start=now, count=7)
    RequestAggregate.objects.create(
        resolution="10s", scope="region", region=region, bucket_start=now, count=7
    )
    for name in ("ap-south-1", "ap-south-2"):
        pk = fleet.nodes[name].pk
        assert operator_client.post(f"/api/v1/nodes/{pk}/drain/").status_code == 200
        assert operator_client.delete(f"/api/v1/nodes/{pk}/").status_code == 204
    assert operator_client.delete(f"/api/v1/regions/{region.pk}/").status_code == 204

    assert RTTSample.objects.get().node_label == "ap-south-1"
    assert RTTSample.objects.get().region_label == "ap-south"
    assert MetricSample.objects.get().node_label == "ap-south-1"
    assert HealthEvent.objects.get().node_label == "ap-south-1"
    assert RequestAggregate.objects.count() == 2
    rows = operator_client.get("/api/v1/telemetry/request-aggregates/").json()["results"]
    assert sorted((r["scope"], r["node"], r["node_name"], r["region"], r["count"]) for r in rows) == [
        ("node", None, "ap-south-1", None, 7),
        ("region", None, None, "ap-south", 7),
    ]
    samples = operator_client.get("/api/v1/telemetry/rtt-samples/").json()["results"]
    assert [(s["region"], s["node"], s["node_name"]) for s in samples] == [("ap-south", None, "ap-south-1")]
