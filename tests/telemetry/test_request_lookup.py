"""Find one request by its x-request-id: the API and the breakdown page answer from the request log."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone

from telemetry import rounds
from telemetry.aggregation import run_round
from telemetry.models import ProcessedRequestEntry
from tests.telemetry.test_request_aggregation import T0, append, fleet, record

__all__ = ["fleet"]  # the fixture, for this module

pytestmark = pytest.mark.django_db


@pytest.fixture
def logged(tel, fleet):
    _regions, node = fleet
    append(
        tel,
        record(node, ts=T0 + 1, ttft_ms=123.0, request_id="req-3f2a", key_id="k7", status=200),
        record(node, ts=T0 + 2, ttft_ms=None, request_id="other", status=401, error="Invalid API key."),
    )
    run_round(tel.client, tel.keys)
    return node


def test_the_api_finds_a_request_by_its_id(viewer_api, logged) -> None:
    response = viewer_api.get("/api/v1/telemetry/requests/req-3f2a/")
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["request_id"] == "req-3f2a"
    assert (body["record"]["status"], body["record"]["ttft_ms"]) == (200, 123.0)
    assert (body["record"]["node_id"], body["record"]["key_id"]) == (logged.pk, "k7")

    listed = viewer_api.get("/api/v1/telemetry/requests/", {"request_id": "other"}).json()
    assert [r["record"]["status"] for r in listed["results"]] == [401]


def test_an_unknown_id_is_a_404_that_says_why(viewer_api, logged) -> None:
    response = viewer_api.get("/api/v1/telemetry/requests/nope/")
    assert response.status_code == 404
    detail = response.json()["detail"]
    assert "'nope'" in detail and "GORGO_RAW_RETENTION_H" in detail


def test_records_go_with_the_raw_retention(logged, settings) -> None:
    ProcessedRequestEntry.objects.update(processed_at=timezone.now() - timedelta(hours=25))
    settings.GORGO_RAW_RETENTION_H = 24
    rounds.prune(None, None)
    assert ProcessedRequestEntry.find("req-3f2a") is None


def test_the_breakdown_page_finds_a_request(logged) -> None:
    user = get_user_model().objects.create_user("viewer-lookup", password="pw-lookup-1")
    client = Client()
    client.force_login(user)
    page = client.get("/breakdown/", {"request_id": "req-3f2a"}).content.decode()
    assert 'id="request-lookup"' in page
    assert "req-3f2a" in page and "123.0 ms" in page and logged.name in page
    missing = client.get("/breakdown/", {"request_id": "nope"}).content.decode()
    assert "No request with x-request-id" in missing
    assert 'name="request_id"' in client.get("/breakdown/").content.decode()  # the search box
