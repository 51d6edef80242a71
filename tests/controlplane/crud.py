"""The generic API test base: declare an endpoint, inherit its CRUD and permission tests.

A subclass sets ``url``, ``model``, ``create_data`` and ``update_data`` and implements ``make(i)``
(save the i-th distinct object). Every test runs on a base fleet of three regions and one model
(``self.regions``, ``self.llm``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
from django.db import connection
from django.db import models as db_models
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

from tests.controlplane.support import make_regions_and_model


class CRUDTests:
    url: ClassVar[str]
    model: ClassVar[type[db_models.Model]]
    create_data: ClassVar[dict[str, Any]]
    update_data: ClassVar[dict[str, Any]]
    # Authentication (token lookup), count, page, and one prefetch per many-to-many field at most.
    max_list_queries: ClassVar[int] = 5

    @pytest.fixture(autouse=True)
    def _base_fleet(self, db) -> None:
        self.regions, self.llm = make_regions_and_model()

    def make(self, index: int) -> db_models.Model:
        raise NotImplementedError

    def detail(self, obj: db_models.Model) -> str:
        return f"{self.url}{obj.pk}/"

    def assert_shows(self, body: dict[str, Any], expected: dict[str, Any]) -> None:
        shown = {key: body[key] for key in expected}
        assert shown == expected

    def test_it_lists(self, viewer_client: APIClient) -> None:
        self.make(1)
        self.make(2)
        response = viewer_client.get(self.url)
        assert response.status_code == 200, response.content
        body = response.json()
        assert body["count"] == self.model.objects.count() >= 2
        assert len(body["results"]) == body["count"]

    def test_it_gets_one(self, viewer_client: APIClient) -> None:
        obj = self.make(1)
        response = viewer_client.get(self.detail(obj))
        assert response.status_code == 200, response.content
        assert response.json()["id"] == obj.pk

    def test_it_creates(self, operator_client: APIClient) -> None:
        before = self.model.objects.count()
        response = operator_client.post(self.url, self.create_data, format="json")
        assert response.status_code == 201, response.content
        assert self.model.objects.count() == before + 1
        created = operator_client.get(self.url + f"{response.json()['id']}/").json()
        self.assert_shows(created, self.create_data)

    def test_it_updates(self, operator_client: APIClient) -> None:
        obj = self.make(1)
        data = {**self.create_data, **self.update_data}
        response = operator_client.put(self.detail(obj), data, format="json")
        assert response.status_code == 200, response.content
        self.assert_shows(operator_client.get(self.detail(obj)).json(), data)

    def test_it_partially_updates(self, operator_client: APIClient) -> None:
        obj = self.make(1)
        response = operator_client.patch(self.detail(obj), self.update_data, format="json")
        assert response.status_code == 200, response.content
        self.assert_shows(response.json(), self.update_data)
        self.assert_shows(operator_client.get(self.detail(obj)).json(), self.update_data)

    def test_it_deletes(self, operator_client: APIClient) -> None:
        obj = self.make(1)
        response = operator_client.delete(self.detail(obj))
        assert response.status_code == 204, response.content
        assert not self.model.objects.filter(pk=obj.pk).exists()

    def test_it_refuses_anonymous_users(self, anon_client: APIClient) -> None:
        obj = self.make(1)
        assert anon_client.get(self.url).status_code == 401
        assert anon_client.get(self.detail(obj)).status_code == 401
        assert anon_client.post(self.url, self.create_data, format="json").status_code == 401
        assert anon_client.patch(self.detail(obj), self.update_data, format="json").status_code == 401
        assert anon_client.delete(self.detail(obj)).status_code == 401
        assert self.model.objects.filter(pk=obj.pk).exists()

    def test_it_lets_viewers_read_but_not_write(self, viewer_client: APIClient) -> None:
        obj = self.make(1)
        before = viewer_client.get(self.detail(obj)).json()
        assert viewer_client.post(self.url, self.create_data, format="json").status_code == 403
        assert viewer_client.put(self.detail(obj), self.create_data, format="json").status_code == 403
        assert viewer_client.patch(self.detail(obj), self.update_data, format="json").status_code == 403
        assert viewer_client.delete(self.detail(obj)).status_code == 403
        after = viewer_client.get(self.detail(obj)).json()
        assert after == before

    def test_it_lists_in_a_bounded_number_of_queries(self, viewer_client: APIClient) -> None:
        self.make(1)
        with CaptureQueriesContext(connection) as few_rows:
            assert viewer_client.get(self.url).status_code == 200
        for index in range(2, 7):
            self.make(index)
        with CaptureQueriesContext(connection) as many_rows:
            response = viewer_client.get(self.url)
        assert response.json()["count"] >= 6
        # The same count with 1 and with 6 rows: no query per row (N+1).
        assert len(many_rows) == len(few_rows) <= self.max_list_queries, [q["sql"] for q in many_rows]
