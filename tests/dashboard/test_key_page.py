"""The Client keys page: operators create (secret shown once), rotate and revoke; viewers look."""

from __future__ import annotations

import hashlib
import re

import pytest
from django.test import Client

from controlplane.keys.models import ClientKey
from routing.contract import ClientKeySet, decode

pytestmark = pytest.mark.django_db(transaction=True)  # the key set is published on commit


def secret_in(response) -> str:
    match = re.search(r'<code id="new-secret">([^<]+)</code>', response.content.decode())
    assert match, response.content.decode()[:2000]
    return match.group(1)


def test_an_operator_creates_a_key_and_sees_its_secret_once(
    operator_client: Client, fleet, redis_conn, cp_keys
):
    response = operator_client.post(
        "/keys/",
        {
            "name": "search",
            "owner": "ana",
            "priority": "batch",
            "requests_per_min": "60",
            "allowed_models": [fleet.model.pk],
        },
    )
    assert response.status_code == 200
    assert response["Cache-Control"] == "no-store"
    secret = secret_in(response)
    key = ClientKey.objects.get()
    assert key.secret_sha256 == hashlib.sha256(secret.encode()).hexdigest()
    listing = operator_client.get("/keys/")
    assert secret.encode() not in listing.content and key.key_id.encode() in listing.content
    published = decode(redis_conn.get(cp_keys.key_set), ClientKeySet)
    assert [spec.id for spec in published.keys] == [key.key_id]


def test_a_bad_form_creates_nothing(operator_client: Client, fleet):
    response = operator_client.post(
        "/keys/", {"name": "", "owner": "ana", "priority": "urgent", "requests_per_min": "0"}
    )
    assert response.status_code == 400
    assert b"Not created" in response.content and ClientKey.objects.count() == 0


def test_rotate_shows_a_new_secret_and_revoke_marks_the_key(operator_client: Client, fleet):
    operator_client.post("/keys/", {"name": "k", "owner": "o", "priority": "interactive"})
    key = ClientKey.objects.get()
    old_hash = key.secret_sha256
    rotated = operator_client.post(f"/keys/{key.pk}/rotate/")
    new_secret = secret_in(rotated)
    key.refresh_from_db()
    assert key.secret_sha256 == hashlib.sha256(new_secret.encode()).hexdigest() != old_hash
    assert operator_client.post(f"/keys/{key.pk}/revoke/").status_code == 302
    key.refresh_from_db()
    assert key.revoked


def test_viewers_see_the_keys_but_cannot_change_them(viewer_client: Client, operator_client: Client, fleet):
    operator_client.post("/keys/", {"name": "k", "owner": "o", "priority": "interactive"})
    key = ClientKey.objects.get()
    page = viewer_client.get("/keys/")
    assert (
        page.status_code == 200 and b"key-form" not in page.content and b'aria-current="page"' in page.content
    )
    assert viewer_client.post("/keys/", {"name": "x", "owner": "y", "priority": "batch"}).status_code == 403
    assert viewer_client.post(f"/keys/{key.pk}/revoke/").status_code == 403
    assert ClientKey.objects.count() == 1
