"""The read-only telemetry API: live state, RTT matrix, samples, aggregates, validation, schema."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest
from drf_spectacular.generators import SchemaGenerator
from rest_framework.test import APIClient

from telemetry.live import merge_node_live, publish_rtt_table, update_rtt
from telemetry.models import HealthEvent, NodeHealth, RequestAggregate, RTTSample
from tests.telemetry.conftest import make_node, make_regions

pytestmark = pytest.mark.django_db

NOW = datetime.now(tz=UTC).replace(microsecond=0)


@pytest.fixture
def fleet(tel):
    regions = make_regions("us-east", "eu-central")
    nodes = {
        "use-1": make_node("use-1", regions["us-east"], "http://127.0.0.1:8101"),
        "euc-1": make_node("euc-1", regions["eu-central"], "http://127.0.0.1:8103"),
    }
    return regions, nodes


def aggregate(resolution: str, start: datetime, **target) -> RequestAggregate:
    scope = "node" if "node" in target else "region"
    return RequestAggregate.objects.create(
        resolution=resolution,
        scope=scope,
        bucket_start=start,
        count=10,
        errors=1,
        ttft_count=10,
        ttft_sum_ms=1500.0,
        gateway_sum_ms=20.0,
        network_sum_ms=880.0,
        queue_sum_ms=200.0,
        prefill_sum_ms=350.0,
        prompt_tokens=1000,
        cached_tokens=400,
        cached_reported_prompt_tokens=1000,
        **target,
    )


def test_it_requires_an_authenticated_user(fleet):
    for url in (
        "/api/v1/telemetry/live-nodes/",
        "/api/v1/telemetry/rtt-matrix/",
        "/api/v1/telemetry/request-aggregates/",
    ):
        assert APIClient().get(url).status_code in (401, 403)


def test_it_shows_live_node_state_with_the_rtt_from_each_region(
    tel, fleet, viewer_api, django_assert_max_num_queries
):
    _regions, nodes = fleet
    node = nodes["euc-1"]
    NodeHealth.objects.create(node=node, health="unhealthy", reason="3 consecutive failed probes")
    merge_node_live(
        tel.client,
        tel.keys,
        {
            node.pk: {
                "healthy": False,
                "num_running": 4.0,
                "num_waiting": 2.0,
                "kv_cache_usage": 0.3,
                "prefix_hit_rate": 0.75,
                "last_scrape_at": time.time() - 3,
            }
        },
        healthy_default={},
    )
    now = time.time()
    update_rtt(tel.client, tel.keys, "us-east", {node.pk: 88.0}, now)
    update_rtt(tel.client, tel.keys, "eu-central", {node.pk: 1.5}, now)
    publish_rtt_table(tel.client, tel.keys, now)

    with django_assert_max_num_queries(2):  # count, page (nodes joined with region and health)
        response = viewer_api.get("/api/v1/telemetry/live-nodes/")

    assert response.status_code == 200
    by_name = {row["name"]: row for row in response.json()["results"]}
    row = by_name["euc-1"]
    assert (row["health"], row["healthy"], row["region"]) == ("unhealthy", False, "eu-central")
    assert (row["num_running"], row["num_waiting"], row["kv_cache_usage"], row["prefix_hit_rate"]) == (
        4.0,
        2.0,
        0.3,
        0.75,
    )
    assert row["last_scrape_age_s"] >= 3.0
    assert {(r["region"], r["rtt_ms"]) for r in row["rtt"]} == {("us-east", 88.0), ("eu-central", 1.5)}
    fresh = by_name["use-1"]
    assert (fresh["health"], fresh["healthy"], fresh["rtt"]) == ("unknown", None, [])


def test_it_returns_the_rtt_matrix(tel, fleet, viewer_api):
    _regions, nodes = fleet
    now = time.time()
    update_rtt(tel.client, tel.keys, "us-east", {nodes["use-1"].pk: 1.4, nodes["euc-1"].pk: 87.0}, now)
    publish_rtt_table(tel.client, tel.keys, now)

    body = viewer_api.get("/api/v1/telemetry/rtt-matrix/").json()

    assert body["regions"] == ["eu-central", "us-east"]
    assert {n["name"] for n in body["nodes"]} == {"use-1", "euc-1"}
    assert {(c["region"], c["node_id"], c["rtt_ms"]) for c in body["cells"]} == {
        ("us-east", nodes["use-1"].pk, 1.4),
        ("us-east", nodes["euc-1"].pk, 87.0),
    }
    assert body["updated_at"] == pytest.approx(now)


def test_an_empty_rtt_matrix_is_not_an_error(fleet, viewer_api):
    body = viewer_api.get("/api/v1/telemetry/rtt-matrix/").json()

    assert body["cells"] == [] and body["updated_at"] is None


def test_it_filters_aggregates_by_time_resolution_node_and_region(fleet, viewer_api):
    regions, nodes = fleet
    old, recent = NOW - timedelta(hours=2), NOW - timedelta(minutes=1)
    aggregate("10s", old, node=nodes["use-1"])
    wanted = aggregate("10s", recent, node=nodes["use-1"])
    aggregate("1m", recent, node=nodes["use-1"])
    aggregate("10s", recent, node=nodes["euc-1"])
    by_region = aggregate("10s", recent, region=regions["us-east"])
    since = (NOW - timedelta(minutes=5)).isoformat()

    body = viewer_api.get(
        "/api/v1/telemetry/request-aggregates/",
        {"since": since, "resolution": "10s", "node": nodes["use-1"].pk},
    ).json()
    by_unix = viewer_api.get(
        "/api/v1/telemetry/request-aggregates/",
        {"since": (NOW - timedelta(minutes=5)).timestamp(), "until": NOW.timestamp(), "region": "us-east"},
    ).json()

    assert [row["id"] for row in body["results"]] == [wanted.pk]
    row = body["results"][0]
    assert row["breakdown"] == {
        "ttft_mean_ms": 150.0,
        "gateway_ms": 2.0,
        "network_ms": 88.0,
        "queue_ms": 20.0,
        "prefill_ms": 35.0,
        "other_ms": 5.0,
        "within_tolerance": True,
    }
    assert (row["error_rate"], row["cache_hit_rate"]) == (0.1, 0.4)
    assert [r["id"] for r in by_unix["results"]] == [by_region.pk]
    assert by_unix["results"][0]["region"] == "us-east"


@pytest.mark.parametrize(
    ("params", "field", "message"),
    [
        ({"resolution": "5m"}, "resolution", "5m is not one of the available choices"),
        ({"since": "yesterday"}, "since", "ISO 8601"),
        ({"until": "2026-13-45T99:00:00Z"}, "until", "ISO 8601"),
        ({"since": "2026-01-02T00:00:00Z", "until": "2026-01-01T00:00:00Z"}, "until", "earlier than since"),
        ({"node": "abc"}, "node", "whole number"),
        ({"node": "99999999999999999999"}, "node", "less than or equal to"),
        ({"scope": "planet"}, "scope", "not one of the available choices"),
    ],
)
def test_it_rejects_bad_parameters_with_a_clear_message(fleet, viewer_api, params, field, message):
    response = viewer_api.get("/api/v1/telemetry/request-aggregates/", params)

    assert response.status_code == 400
    assert message in " ".join(response.json()[field])


@pytest.mark.parametrize("params", [{"node": "999999"}, {"region": "atlantis"}])
def test_an_unknown_node_or_region_matches_nothing(fleet, viewer_api, params):
    # A valid question whose answer is "none": an empty page, not an error.
    response = viewer_api.get("/api/v1/telemetry/request-aggregates/", params)
    assert (response.status_code, response.json()["count"]) == (200, 0)


def test_the_aggregate_list_does_not_query_per_row(fleet, viewer_api, django_assert_max_num_queries):
    regions, _nodes = fleet
    for minutes in range(20):
        aggregate("1m", NOW - timedelta(minutes=minutes), region=regions["us-east"])

    with django_assert_max_num_queries(3):  # region lookup, count, page: not one per row
        response = viewer_api.get("/api/v1/telemetry/request-aggregates/", {"region": "us-east"})

    assert response.json()["count"] == 20


def test_it_lists_rtt_samples_and_health_events_by_region_and_time(fleet, viewer_api):
    regions, nodes = fleet
    RTTSample.objects.create(region=regions["us-east"], node=nodes["euc-1"], ts=NOW, ok=True, rtt_ms=88.2)
    RTTSample.objects.create(region=regions["eu-central"], node=nodes["euc-1"], ts=NOW, ok=True, rtt_ms=1.6)
    HealthEvent.objects.create(
        node=nodes["euc-1"], ts=NOW, previous="healthy", current="unhealthy", source="probe"
    )
    HealthEvent.objects.create(
        node=nodes["euc-1"], ts=NOW - timedelta(days=2), previous="unknown", current="healthy", source="probe"
    )

    samples = viewer_api.get("/api/v1/telemetry/rtt-samples/", {"region": "us-east"}).json()
    events = viewer_api.get(
        "/api/v1/telemetry/health-events/", {"since": (NOW - timedelta(hours=1)).isoformat()}
    )

    assert [(s["region"], s["rtt_ms"]) for s in samples["results"]] == [("us-east", 88.2)]
    assert [(e["previous"], e["current"]) for e in events.json()["results"]] == [("healthy", "unhealthy")]


def test_the_endpoints_are_in_the_openapi_schema(db):
    schema = SchemaGenerator().get_schema(request=None, public=True)

    paths = schema["paths"]
    for path in (
        "/api/v1/telemetry/live-nodes/",
        "/api/v1/telemetry/rtt-matrix/",
        "/api/v1/telemetry/rtt-samples/",
        "/api/v1/telemetry/metric-samples/",
        "/api/v1/telemetry/health-events/",
        "/api/v1/telemetry/request-aggregates/",
    ):
        assert "get" in paths[path]
    parameters = {p["name"]: p for p in paths["/api/v1/telemetry/request-aggregates/"]["get"]["parameters"]}
    assert {"since", "until", "resolution", "node", "region"} <= set(parameters)
    assert parameters["resolution"]["schema"]["enum"] == ["10s", "1m"]
