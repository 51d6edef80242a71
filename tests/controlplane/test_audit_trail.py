"""Changes made through the API land in the same audit trail as the dashboard's and the admin's."""

from __future__ import annotations

import pytest
from django.contrib.admin.models import ADDITION, CHANGE, DELETION, LogEntry

from controlplane.fleet.models import Node, Region

pytestmark = pytest.mark.django_db


def entries_for(obj) -> list[tuple[int, str, str]]:
    return [
        (e.action_flag, e.user.username, e.change_message)
        for e in LogEntry.objects.filter(object_id=str(obj.pk), object_repr=str(obj)).order_by("pk")
    ]


def test_it_records_drain_and_enable_with_who(operator_client, fleet) -> None:
    node = Node.objects.get(name="us-east-1")
    assert operator_client.post(f"/api/v1/nodes/{node.pk}/drain/").status_code == 200
    assert operator_client.post(f"/api/v1/nodes/{node.pk}/drain/").status_code == 200  # no change: no entry
    assert operator_client.post(f"/api/v1/nodes/{node.pk}/enable/").status_code == 200
    assert entries_for(node) == [
        (CHANGE, "op", "state: active -> draining (through the API)"),
        (CHANGE, "op", "state: draining -> active (through the API)"),
    ]


def test_it_records_create_update_and_delete(operator_client) -> None:
    created = operator_client.post(
        "/api/v1/regions/", {"slug": "sa-east", "name": "Sao Paulo", "latitude": -23.5, "longitude": -46.6}
    )
    assert created.status_code == 201, created.content
    region = Region.objects.get(slug="sa-east")
    assert operator_client.patch(f"/api/v1/regions/{region.pk}/", {"name": "São Paulo"}).status_code == 200
    entries = entries_for(Region.objects.get(pk=region.pk))
    assert entries[0] == (ADDITION, "op", "Created through the API.")
    assert entries[1][0] == CHANGE and "name: Sao Paulo -> São Paulo" in entries[1][2]
    assert operator_client.delete(f"/api/v1/regions/{region.pk}/").status_code == 204
    assert LogEntry.objects.filter(object_id=str(region.pk), action_flag=DELETION).count() == 1


def test_it_records_which_policy_parameters_changed(operator_client, fleet) -> None:
    created = operator_client.post(
        "/api/v1/policies/", {"name": "p", "algorithm": "gorgo", "params": {"w_rtt": 1.0}}, format="json"
    )
    assert created.status_code == 201, created.content
    pk = created.json()["id"]
    assert (
        operator_client.patch(
            f"/api/v1/policies/{pk}/", {"params": {"w_rtt": 2.5}}, format="json"
        ).status_code
        == 200
    )
    message = LogEntry.objects.filter(object_id=str(pk), action_flag=CHANGE).get().change_message
    assert message == "Changed through the API: params.w_rtt: 1.0 -> 2.5"


def test_every_model_the_api_edits_says_its_own_audit_state() -> None:
    from controlplane.api import BaseModelViewSet
    from controlplane.audit import Audited
    from controlplane.urls import urlpatterns  # noqa: F401  (registers every API viewset)

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    edited = {viewset.queryset.model for viewset in subclasses(BaseModelViewSet)}
    assert edited and all(issubclass(model, Audited) for model in edited), edited
