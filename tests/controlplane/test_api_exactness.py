"""The API is exact: strict types, bounded pages, every error documented, nullable fields declared."""

from __future__ import annotations

import pytest

from controlplane.policies.models import PolicyVersion, RoutingPolicy

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("url", ["/api/v1/regions/", "/api/v1/policies/", "/api/v1/models/"])
@pytest.mark.parametrize(
    "query",
    [
        {"limit": "9223372036854775808"},
        {"limit": "100000000"},
        {"limit": "0"},
        {"limit": "-1"},
        {"limit": "abc"},
        {"limit": ""},
        {"offset": "9223372036854775808"},
        {"offset": "-1"},
        {"offset": "null"},
    ],
)
def test_it_answers_400_for_a_limit_or_offset_out_of_range(viewer_client, fleet, url, query) -> None:
    response = viewer_client.get(url, query)
    assert response.status_code == 400, response.content
    assert list(response.json()) == list(query)


def test_it_serves_pages_of_up_to_a_thousand(viewer_client, fleet) -> None:
    assert viewer_client.get("/api/v1/nodes/", {"limit": "1000", "offset": "2"}).json()["count"] == 6
    assert len(viewer_client.get("/api/v1/nodes/", {"limit": "2"}).json()["results"]) == 2


def test_it_refuses_a_name_that_is_not_a_string(operator_client, fleet) -> None:
    response = operator_client.patch(f"/api/v1/models/{fleet.model.pk}/", {"name": 0}, format="json")
    assert response.status_code == 400, response.content
    assert "name" in response.json()
    assert (
        operator_client.patch(f"/api/v1/nodes/{fleet.nodes['us-east-1'].pk}/", {"models": [0]}).status_code
        == 400
    )
    assert (
        operator_client.patch(f"/api/v1/nodes/{fleet.nodes['us-east-1'].pk}/", {"gpu_count": "2"}).status_code
        == 400
    )
    assert (
        operator_client.patch(
            f"/api/v1/regions/{fleet.regions['us-east'].pk}/", {"latitude": "1"}
        ).status_code
        == 400
    )


def test_a_put_without_params_is_refused_and_changes_nothing(operator_client, fleet) -> None:
    policy = RoutingPolicy.objects.create(name="default", algorithm="gorgo", params={"w_rtt": 1.25})
    response = operator_client.put(
        f"/api/v1/policies/{policy.pk}/", {"name": "default", "algorithm": "gorgo"}
    )
    assert response.status_code == 400, response.content
    assert list(response.json()) == ["params"]
    policy.refresh_from_db()
    assert policy.params == {"w_rtt": 1.25}


def test_a_rollback_note_must_be_text(operator_client, fleet, cp_keys) -> None:
    policy = RoutingPolicy.objects.create(name="default", algorithm="gorgo", params={})
    assert operator_client.post(f"/api/v1/policies/{policy.pk}/publish/").status_code == 201
    response = operator_client.post(f"/api/v1/policies/{policy.pk}/rollback/", {"version": 1, "note": 0})
    assert response.status_code == 400, response.content
    assert list(response.json()) == ["note"]
    assert PolicyVersion.objects.count() == 1


def test_a_taken_name_is_a_conflict(operator_client, fleet) -> None:
    response = operator_client.post(
        "/api/v1/regions/", {"slug": "us-east", "name": "x", "latitude": 1, "longitude": 1}
    )
    assert response.status_code == 409, response.content
    assert list(response.json()) == ["slug"]


def test_unknown_api_urls_answer_json_404(operator_client) -> None:
    for method in ("get", "delete", "patch"):
        response = getattr(operator_client, method)("/api/v1/regions/0.5/")
        assert response.status_code == 404
        assert response.json() == {"detail": "Not found."}


def schema(client) -> dict:
    return client.get("/api/schema/", {"format": "json"}).json()


def test_the_schema_declares_nullable_fields(viewer_client) -> None:
    components = schema(viewer_client)["components"]["schemas"]
    assert components["RequestAggregate"]["properties"]["region"]["nullable"] is True
    assert components["RoutingPolicy"]["properties"]["live_version"]["nullable"] is True
    assert components["LiveNode"]["properties"]["health_changed_at"]["nullable"] is True


def test_the_schema_documents_every_error_answer(viewer_client) -> None:
    paths = schema(viewer_client)["paths"]
    for path, operations in paths.items():
        for method, operation in operations.items():
            codes = set(operation["responses"])
            assert {"400", "401", "403", "429"} <= codes, (method, path)
            if "{" in path:
                assert "404" in codes, (method, path)
            if method in {"post", "put", "patch", "delete"}:
                assert "409" in codes, (method, path)
    limit = next(p for p in paths["/api/v1/regions/"]["get"]["parameters"] if p["name"] == "limit")
    assert (limit["schema"]["minimum"], limit["schema"]["maximum"]) == (1, 1000)


def test_a_server_error_answers_api_clients_in_json_without_details(rf) -> None:
    from controlplane.urls import handler500

    response = handler500(rf.get("/api/v1/regions/"))
    assert response.status_code == 500
    assert response["Content-Type"] == "application/json"
    assert b"Traceback" not in response.content and b"settings" not in response.content.lower()
    page = handler500(rf.get("/nodes/"))
    assert (page.status_code, b"Traceback" in page.content) == (500, False)


def test_it_refuses_an_unknown_field_by_name_and_changes_nothing(operator_client, fleet) -> None:
    policy = RoutingPolicy.objects.create(name="default", algorithm="gorgo", params={})
    response = operator_client.patch(f"/api/v1/policies/{policy.pk}/", {"max_rtt": 100}, format="json")
    assert response.status_code == 400, response.content
    assert response.json() == {"max_rtt": ["Unknown field."]}
    response = operator_client.patch(
        f"/api/v1/regions/{fleet.regions['us-east'].pk}/", {"name": "East", "nmae": "x"}, format="json"
    )
    assert (response.status_code, list(response.json())) == (400, ["nmae"])
    assert fleet.regions["us-east"].name != "East"
    fleet.regions["us-east"].refresh_from_db()
    assert fleet.regions["us-east"].name != "East"
    # Request bodies of actions, and nested objects, are exact too.
    response = operator_client.post(f"/api/v1/policies/{policy.pk}/publish/", {"notes": "typo"})
    assert (response.status_code, list(response.json())) == (400, ["notes"])
    response = operator_client.patch(
        f"/api/v1/policies/{policy.pk}/",
        {"residency": [{"client_region": "us-east", "node_regions": ["us-east"], "strict": True}]},
    )
    assert response.status_code == 400, response.content
    assert PolicyVersion.objects.count() == 0


def test_it_refuses_a_read_only_field_saying_how_to_do_it(operator_client, fleet) -> None:
    policy = RoutingPolicy.objects.create(name="default", algorithm="gorgo", params={})
    response = operator_client.patch(f"/api/v1/policies/{policy.pk}/", {"is_active": True})
    assert response.status_code == 400, response.content
    assert "publish" in response.json()["is_active"][0]
    policy.refresh_from_db()
    assert policy.is_active is False


@pytest.mark.parametrize(
    "url",
    [
        "/api/v1/regions/",
        "/api/v1/policies/",
        "/api/v1/policy-versions/",
        "/api/v1/nodes/",
        "/api/v1/client-keys/",
        "/api/v1/telemetry/live-nodes/",
        "/api/v1/telemetry/rtt-matrix/",
        "/api/v1/telemetry/request-aggregates/",
    ],
)
def test_it_refuses_an_unknown_query_parameter_by_name(viewer_client, fleet, url) -> None:
    response = viewer_client.get(url, {"search": "x"})
    assert response.status_code == 400, response.content
    assert response.json() == {"search": ["Unknown query parameter."]}


def test_a_detail_takes_no_list_parameters(viewer_client, fleet) -> None:
    region = fleet.regions["us-east"]
    assert viewer_client.get(f"/api/v1/regions/{region.pk}/").status_code == 200
    response = viewer_client.get(f"/api/v1/regions/{region.pk}/", {"limit": "5"})
    assert (response.status_code, list(response.json())) == (400, ["limit"])


def test_every_documented_query_parameter_is_accepted(viewer_client, fleet) -> None:
    """The mechanism and the schema agree: each list operation's parameters are taken."""
    paths = schema(viewer_client)["paths"]
    checked = 0
    for path, operations in paths.items():
        get = operations.get("get")
        if get is None or "{" in path:
            continue
        names = [p["name"] for p in get.get("parameters", []) if p["in"] == "query"]
        for name in names:
            response = viewer_client.get(path, {name: "1"})
            assert "Unknown query parameter." not in response.content.decode(), (path, name)
            checked += 1
    assert checked > 30


def test_the_schema_closes_request_bodies(viewer_client) -> None:
    components = schema(viewer_client)["components"]["schemas"]
    assert components["PatchedRoutingPolicyRequest"]["additionalProperties"] is False
    assert components["PublishRequestRequest"]["additionalProperties"] is False
    assert components["RegionRequest"]["additionalProperties"] is False


def test_a_method_the_route_lacks_is_a_405_even_with_unknown_parameters(operator_client, fleet) -> None:
    assert operator_client.put("/api/v1/policy-versions/", {}, QUERY_STRING="x=1").status_code == 405


def test_a_string_longer_than_its_max_length_is_refused_before_trimming(operator_client, fleet) -> None:
    node = fleet.nodes["us-east-1"]
    response = operator_client.patch(f"/api/v1/nodes/{node.pk}/", {"base_url": "/x" + " " * 600})
    assert (response.status_code, list(response.json())) == (400, ["base_url"])
    response = operator_client.patch(
        f"/api/v1/regions/{fleet.regions['us-east'].pk}/", {"name": "x" + " " * 200}
    )
    assert (response.status_code, list(response.json())) == (400, ["name"])
