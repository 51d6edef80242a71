"""GET /api/v1/telemetry/key-usage/: per-key buckets, filtered by key, team, priority and time."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from drf_spectacular.generators import SchemaGenerator

from controlplane.keys.models import ClientKey
from telemetry.models import KeyUsageAggregate

pytestmark = pytest.mark.django_db

NOW = datetime.now(tz=UTC).replace(microsecond=0)
URL = "/api/v1/telemetry/key-usage/"


def make_key(name: str, team: str) -> tuple[ClientKey, str]:
    key = ClientKey(name=name, owner="ana", team=team)
    secret = key.set_new_secret()
    key.save()
    return key, secret


def usage(key: ClientKey, start: datetime, resolution: str = "1m", **fields) -> KeyUsageAggregate:
    values = {
        "count": 10,
        "errors_4xx": 2,
        "errors_5xx": 1,
        "limited": 1,
        "refused": 1,
        "prompt_tokens": 1000,
        "completion_tokens": 200,
        "cached_tokens": 400,
        "usage_count": 7,
        "ttft_count": 7,
        "ttft_sum_ms": 700.0,
        "ttft_p50_ms": 95.0,
        "ttft_p99_ms": 180.0,
        "priority": key.priority,
    } | fields
    return KeyUsageAggregate.objects.create(
        resolution=resolution, bucket_start=start, key_id=key.key_id, client_key=key, team=key.team, **values
    )


def test_it_lists_a_keys_buckets_with_its_usage_and_never_its_secret(tel, viewer_api):
    key, secret = make_key("search", "retrieval")
    other, _ = make_key("nightly", "analytics")
    wanted = usage(key, NOW - timedelta(minutes=1))
    usage(key, NOW - timedelta(hours=2))
    usage(key, NOW - timedelta(minutes=1), resolution="10s")
    usage(other, NOW - timedelta(minutes=1))

    response = viewer_api.get(
        URL, {"key": key.key_id, "resolution": "1m", "since": (NOW - timedelta(minutes=15)).isoformat()}
    )

    assert response.status_code == 200
    body = response.json()
    assert [row["id"] for row in body["results"]] == [wanted.pk]
    row = body["results"][0]
    assert {k: row[k] for k in ("key_id", "key_name", "team", "priority")} == {
        "key_id": key.key_id,
        "key_name": "search",
        "team": "retrieval",
        "priority": "interactive",
    }
    assert (row["count"], row["errors"], row["errors_4xx"], row["errors_5xx"], row["error_rate"]) == (
        10,
        3,
        2,
        1,
        0.3,
    )
    assert (row["limited"], row["refused"], row["prompt_tokens"], row["completion_tokens"]) == (
        1,
        1,
        1000,
        200,
    )
    assert (row["ttft_mean_ms"], row["ttft_p50_ms"], row["ttft_p99_ms"]) == (100.0, 95.0, 180.0)
    assert secret not in response.content.decode() and key.secret_sha256 not in response.content.decode()


def test_it_filters_by_team_and_priority_and_keeps_deleted_keys_by_id(tel, viewer_api):
    search, _ = make_key("search", "retrieval")
    chat, _ = make_key("chat", "retrieval")
    nightly, _ = make_key("nightly", "analytics")
    usage(search, NOW)
    usage(chat, NOW, priority="batch")
    usage(nightly, NOW)
    gone_id = chat.key_id
    chat.delete()

    team = viewer_api.get(URL, {"team": "retrieval"}).json()
    batch = viewer_api.get(URL, {"priority": "batch"}).json()
    deleted = viewer_api.get(URL, {"key": gone_id}).json()

    assert sorted(row["key_id"] for row in team["results"]) == sorted([search.key_id, gone_id])
    assert [row["key_id"] for row in batch["results"]] == [gone_id]
    assert [(row["key_name"], row["team"]) for row in deleted["results"]] == [(None, "retrieval")]


@pytest.mark.parametrize(
    ("params", "field", "message"),
    [
        ({"resolution": "5m"}, "resolution", "5m is not one of the available choices"),
        ({"priority": "urgent"}, "priority", "urgent is not one of the available choices"),
        ({"since": "yesterday"}, "since", "ISO 8601"),
        ({"since": "2026-01-02T00:00:00Z", "until": "2026-01-01T00:00:00Z"}, "until", "earlier than since"),
        ({"key": "x" * 17}, "key", "at most 16 characters"),
    ],
)
def test_it_rejects_bad_parameters_with_a_clear_message(tel, viewer_api, params, field, message):
    response = viewer_api.get(URL, params)

    assert response.status_code == 400
    assert message in " ".join(response.json()[field])


def test_the_list_does_not_query_per_row(tel, viewer_api, django_assert_max_num_queries):
    for i in range(12):
        key, _ = make_key(f"k{i}", "retrieval")
        usage(key, NOW - timedelta(minutes=i))

    with django_assert_max_num_queries(2):  # count, page (keys joined): not one per row
        response = viewer_api.get(URL, {"team": "retrieval"})

    assert response.json()["count"] == 12
    assert len({row["key_name"] for row in response.json()["results"]}) == 12


def test_it_requires_an_authenticated_user(tel, client):
    assert client.get(URL).status_code in (401, 403)


def test_it_is_in_the_openapi_schema_with_its_nullable_fields(db):
    schema = SchemaGenerator().get_schema(request=None, public=True)

    parameters = {p["name"] for p in schema["paths"][URL]["get"]["parameters"]}
    assert {"since", "until", "resolution", "key", "team", "priority", "limit", "offset"} <= parameters
    properties = schema["components"]["schemas"]["KeyUsage"]["properties"]
    for name in ("key_name", "error_rate", "ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms"):
        assert properties[name].get("nullable") is True, name
    assert "secret_sha256" not in properties


def test_the_admin_lists_the_buckets_read_only(tel, admin_client):
    key, secret = make_key("search", "retrieval")
    row = usage(key, NOW)

    listing = admin_client.get("/admin/telemetry/keyusageaggregate/?q=retrieval")

    assert listing.status_code == 200 and key.key_id in listing.content.decode()
    assert secret not in listing.content.decode()
    assert admin_client.get("/admin/telemetry/keyusageaggregate/add/").status_code == 403
    assert admin_client.post(f"/admin/telemetry/keyusageaggregate/{row.pk}/change/", {}).status_code == 403
