"""The admin's client-key pages: the secret is shown once on the answer to the save, never in a cookie."""

from __future__ import annotations

import hashlib
import re

import pytest

from controlplane.keys.models import ClientKey

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def admin(client, operator):
    client.force_login(operator.user)
    return client


def test_adding_a_key_shows_its_secret_once(admin, fleet, cp_keys):
    assert admin.get("/admin/keys/clientkey/").status_code == 200
    response = admin.post(
        "/admin/keys/clientkey/add/",
        {"name": "admin-made", "owner": "ops", "team": "", "priority": "interactive"},
    )
    assert response.status_code == 200, response.content[:500]
    secret = re.search(rb'<code id="client-key-secret">([^<]+)</code>', response.content).group(1).decode()
    assert ClientKey.objects.get().secret_sha256 == hashlib.sha256(secret.encode()).hexdigest()
    assert "no-store" in response["Cache-Control"]
    assert all(secret not in morsel.value for morsel in response.cookies.values())
    assert secret.encode() not in admin.get("/admin/keys/clientkey/").content


def test_the_revoke_action_revokes(admin, fleet, cp_keys):
    admin.post("/admin/keys/clientkey/add/", {"name": "k", "owner": "o", "team": "", "priority": "batch"})
    key = ClientKey.objects.get()
    admin.post("/admin/keys/clientkey/", {"action": "revoke_keys", "_selected_action": [key.pk]})
    key.refresh_from_db()
    assert key.revoked
