"""Version history stays paged and fast with 10,000 versions, in the API and on the policy page."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from controlplane.policies.models import PolicyVersion, RoutingPolicy
from controlplane.policies.publishing import compile_policy
from routing import contract

pytestmark = pytest.mark.django_db

VERSIONS = 10_000


@pytest.fixture
def long_history() -> RoutingPolicy:
    policy = RoutingPolicy.objects.create(name="default", algorithm="gorgo", is_active=True)
    now = timezone.now()
    snapshot = compile_policy(policy)
    document = contract.encode(snapshot).decode()
    PolicyVersion.objects.bulk_create(
        PolicyVersion(
            policy=policy,
            number=n,
            checksum=snapshot.checksum,
            snapshot=document,
            author_name="system",
            note=f"fleet change {n}",
            published_at=now,
        )
        for n in range(1, VERSIONS + 1)
    )
    return policy


def test_the_policy_page_shows_one_page_of_versions(operator_client, long_history) -> None:
    with CaptureQueriesContext(connection) as queries:
        page = operator_client.get(f"/policies/{long_history.pk}/")
    assert page.status_code == 200
    html = page.content.decode()
    assert html.count("data-version=") == 25
    assert 'data-version="10000"' in html and 'data-version="9975"' not in html
    assert "page 1 of 400 (10000 versions)" in html
    assert len(queries) < 40
    older = operator_client.get(f"/policies/{long_history.pk}/", {"page": 400}).content.decode()
    assert 'data-version="1"' in older and 'data-version="26"' not in older
    assert operator_client.get(f"/policies/{long_history.pk}/", {"page": "x"}).status_code == 200


def test_the_api_pages_versions_in_a_bounded_number_of_queries(operator_client, long_history) -> None:
    with CaptureQueriesContext(connection) as queries:
        response = operator_client.get("/api/v1/policy-versions/", {"limit": 50, "offset": 9_990})
    assert response.status_code == 200
    body = response.json()
    assert body["count"] == VERSIONS
    assert [v["number"] for v in body["results"]] == list(range(10, 0, -1))
    assert len(queries) <= 4  # token, count, page (policy and rollback source joined)
