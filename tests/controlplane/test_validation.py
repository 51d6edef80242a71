"""Bad input is refused with field errors, by the API and the admin alike (both use Model.clean())."""

from __future__ import annotations

import pytest

from controlplane.fleet.models import Node
from controlplane.policies.models import RoutingPolicy
from tests.controlplane.support import LLAMA

NODE = {"name": "new-node", "region": "eu-central", "base_url": "http://127.0.0.1:9300", "models": [LLAMA]}
POLICY = {"name": "checked", "algorithm": "gorgo", "params": {}}


def errors_of(response) -> dict:
    assert response.status_code == 400, response.content
    return response.json()


@pytest.mark.parametrize(
    "base_url",
    ["ftp://127.0.0.1:9300", "127.0.0.1:9300", "http://", "http://127.0.0.1:9300/v1"],
)
def test_it_refuses_a_base_url_that_is_not_an_http_server_root(operator_client, fleet, base_url) -> None:
    errors = errors_of(operator_client.post("/api/v1/nodes/", {**NODE, "base_url": base_url}, format="json"))
    assert list(errors) == ["base_url"]
    assert not Node.objects.filter(name="new-node").exists()


@pytest.mark.parametrize("base_url", ["http://127.0.0.1:9101", "http://127.0.0.1:9101/"])
def test_it_refuses_a_duplicate_base_url_as_a_conflict(operator_client, fleet, base_url) -> None:
    response = operator_client.post("/api/v1/nodes/", {**NODE, "base_url": base_url}, format="json")
    assert response.status_code == 409, response.content
    assert list(response.json()) == ["base_url"]


def test_it_refuses_unknown_regions_and_models_on_nodes(operator_client, fleet) -> None:
    errors = errors_of(
        operator_client.post("/api/v1/nodes/", {**NODE, "region": "mars", "models": ["nope"]}, format="json")
    )
    assert set(errors) == {"region", "models"}


def test_it_refuses_labels_that_are_not_strings(operator_client, fleet) -> None:
    errors = errors_of(operator_client.post("/api/v1/nodes/", {**NODE, "labels": {"rack": 7}}, format="json"))
    assert list(errors) == ["labels"]


@pytest.mark.parametrize(
    ("field", "value"), [("latitude", 90.5), ("latitude", -91), ("longitude", 180.01), ("longitude", -200)]
)
def test_it_refuses_coordinates_out_of_range(operator_client, db, field, value) -> None:
    region = {"slug": "somewhere", "name": "Somewhere", "latitude": 10, "longitude": 10, field: value}
    errors = errors_of(operator_client.post("/api/v1/regions/", region, format="json"))
    assert list(errors) == [field]


def test_it_refuses_a_slug_with_spaces(operator_client, db) -> None:
    region = {"slug": "Some Where", "name": "Somewhere", "latitude": 10, "longitude": 10}
    assert list(errors_of(operator_client.post("/api/v1/regions/", region, format="json"))) == ["slug"]


@pytest.mark.parametrize(
    ("algorithm", "params", "mentions"),
    [
        ("gorgo", {"w_rtt": -1}, "w_rtt"),
        ("gorgo", {"w_queue": "fast"}, "w_queue"),
        ("gorgo", {"bogus": 1}, "bogus"),
        ("prefix_affinity", {"cache_threshold": 2}, "cache_threshold"),
        ("prefix_affinity", {"balance_rel_threshold": 0.5}, "balance_rel_threshold"),
        ("session_affinity", {"virtual_nodes": 0}, "virtual_nodes"),
        ("session_affinity", {"session_header": "bad header!"}, "session_header"),
        ("round_robin", {"w_rtt": 1}, "w_rtt"),
        ("least_load", {"cache_threshold": 0.1}, "cache_threshold"),
        ("gorgo", [1, 2], "dictionary"),
    ],
)
def test_it_refuses_bad_params_per_algorithm(operator_client, fleet, algorithm, params, mentions) -> None:
    body = {**POLICY, "algorithm": algorithm, "params": params}
    errors = errors_of(operator_client.post("/api/v1/policies/", body, format="json"))
    assert list(errors) == ["params"]
    assert mentions in " ".join(errors["params"])
    assert not RoutingPolicy.objects.filter(name="checked").exists()


def test_it_reports_each_bad_parameter_by_name(operator_client, fleet) -> None:
    body = {**POLICY, "algorithm": "gorgo", "params": {"w_rtt": 500, "default_rtt_ms": -1}}
    errors = errors_of(operator_client.post("/api/v1/policies/", body, format="json"))
    assert errors == {"params": ["w_rtt: Must be at most 100.", "default_rtt_ms: Must be at least 0."]}


def test_it_accepts_the_params_of_each_algorithm(operator_client, fleet) -> None:
    for algorithm, params in [
        ("gorgo", {"w_rtt": 0.5, "default_rtt_ms": 80}),
        ("prefix_affinity", {"cache_threshold": 0.4}),
        ("session_affinity", {"session_header": "x-user"}),
        ("round_robin", {}),
        ("least_load", {}),
    ]:
        body = {**POLICY, "name": algorithm, "algorithm": algorithm, "params": params}
        assert operator_client.post("/api/v1/policies/", body, format="json").status_code == 201


@pytest.mark.parametrize(
    "residency",
    [
        [{"client_region": "mars", "node_regions": ["eu-central"]}],
        [{"client_region": "eu-central", "node_regions": ["eu-central", "atlantis"]}],
        [
            {"client_region": "eu-central", "node_regions": ["eu-central"]},
            {"client_region": "eu-central", "node_regions": ["us-east"]},
        ],
        [{"client_region": "eu-central", "node_regions": []}],
        [{"client_region": "eu-central"}],
        "eu-central",
    ],
)
def test_it_refuses_bad_residency_rules(operator_client, fleet, residency) -> None:
    errors = errors_of(
        operator_client.post("/api/v1/policies/", {**POLICY, "residency": residency}, format="json")
    )
    assert list(errors) == ["residency"]


def test_it_names_the_unknown_residency_region(operator_client, fleet) -> None:
    residency = [{"client_region": "mars", "node_regions": ["eu-central"]}]
    errors = errors_of(
        operator_client.post("/api/v1/policies/", {**POLICY, "residency": residency}, format="json")
    )
    assert "mars" in " ".join(errors["residency"])


@pytest.mark.parametrize("max_rtt_ms", [-5, 0, 10_001])
def test_it_refuses_a_max_rtt_out_of_range(operator_client, fleet, max_rtt_ms) -> None:
    errors = errors_of(
        operator_client.post("/api/v1/policies/", {**POLICY, "max_rtt_ms": max_rtt_ms}, format="json")
    )
    assert list(errors) == ["max_rtt_ms"]


def test_it_validates_partial_updates_against_the_stored_object(operator_client, fleet) -> None:
    policy = RoutingPolicy.objects.create(name="p", algorithm="gorgo", params={"w_rtt": 2.0})
    # Switching the algorithm alone leaves gorgo's params, which prefix_affinity does not accept.
    response = operator_client.patch(
        f"/api/v1/policies/{policy.pk}/", {"algorithm": "prefix_affinity"}, format="json"
    )
    assert list(errors_of(response)) == ["params"]
    policy.refresh_from_db()
    assert policy.algorithm == "gorgo"


def test_it_refuses_the_same_bad_node_in_the_admin(client, fleet) -> None:
    from controlplane.accounts import ensure_account

    client.force_login(ensure_account("admin-op", password="operator-password-2").user)
    response = client.post(
        "/admin/fleet/node/add/",
        {
            "name": "new-node",
            "region": fleet.regions["eu-central"].pk,
            "base_url": "ftp://127.0.0.1:9300",
            "served_models": [fleet.model.pk],
            "gpu_type": "H100",
            "gpu_count": 1,
            "max_num_seqs": 256,
            "prefill_tokens_per_s": 20000,
            "kv_capacity_tokens": 500000,
            "state": "active",
            "labels": "{}",
        },
    )
    assert response.status_code == 200  # the form again, with errors
    assert "base_url" in response.context["adminform"].form.errors
    assert not Node.objects.filter(name="new-node").exists()
