"""/api/v1/client-keys/: the secret is shown once, stored as a hash, and keys reach Redis at once."""

from __future__ import annotations

import hashlib

import pytest
from django.db import transaction

from controlplane.keys.api.serializers import ClientKeySerializer
from controlplane.keys.models import ClientKey
from routing.contract import ClientKeySet, decode
from tests.controlplane.support import client_for, edit_racing

pytestmark = pytest.mark.django_db(transaction=True)  # on_commit publishing runs as in production

URL = "/api/v1/client-keys/"


def key_set(redis_conn, cp_keys) -> ClientKeySet:
    return decode(redis_conn.get(cp_keys.key_set), ClientKeySet)


def create(client, **fields):
    body = {"name": "search", "owner": "ana", "team": "search", **fields}
    return client.post(URL, body, format="json")


def test_it_shows_the_secret_once_and_stores_only_its_hash(operator_client, fleet, redis_conn, cp_keys):
    response = create(operator_client, models=[fleet.model.name], requests_per_min=60, priority="batch")
    assert response.status_code == 201, response.content
    created = response.json()
    secret = created["secret"]
    assert secret.startswith(f"gorgo-sk-{created['key_id']}-") and len(secret) > 40
    key = ClientKey.objects.get(pk=created["id"])
    assert key.secret_sha256 == hashlib.sha256(secret.encode()).hexdigest()

    listed = operator_client.get(URL).json()["results"]
    detail = operator_client.get(f"{URL}{created['id']}/").json()
    assert secret not in str(listed) and "secret" not in detail
    assert detail["prefix"] == f"gorgo-sk-{created['key_id']}-"

    published = key_set(redis_conn, cp_keys)
    (spec,) = published.keys
    assert (spec.id, spec.secret_sha256, spec.models, spec.priority) == (
        created["key_id"],
        key.secret_sha256,
        (fleet.model.name,),
        "batch",
    )
    assert spec.requests_per_min == 60
    assert secret.encode() not in redis_conn.get(cp_keys.key_set)


def test_revoke_and_rotate_reach_redis(operator_client, fleet, redis_conn, cp_keys):
    created = create(operator_client).json()
    version = key_set(redis_conn, cp_keys).version

    rotated = operator_client.post(f"{URL}{created['id']}/rotate/")
    assert rotated.status_code == 200
    new_secret = rotated.json()["secret"]
    assert new_secret != created["secret"]
    rotated_set = key_set(redis_conn, cp_keys)
    assert rotated_set.version > version
    assert rotated_set.keys[0].secret_sha256 == hashlib.sha256(new_secret.encode()).hexdigest()

    revoked = operator_client.post(f"{URL}{created['id']}/revoke/")
    assert revoked.status_code == 200 and revoked.json()["revoked"] is True
    assert key_set(redis_conn, cp_keys).keys[0].revoked is True


def test_it_validates_limits_and_names(operator_client, fleet):
    bad = create(operator_client, requests_per_min=0, models=["no-such-model"], priority="urgent")
    assert bad.status_code == 400
    assert set(bad.json()) >= {"requests_per_min", "models", "priority"}
    assert ClientKey.objects.count() == 0


def test_viewers_may_list_but_not_create_or_revoke(viewer_client, operator_client, fleet):
    created = create(operator_client).json()
    assert viewer_client.get(URL).status_code == 200
    assert create(viewer_client).status_code == 403
    assert viewer_client.post(f"{URL}{created['id']}/revoke/").status_code == 403


def test_it_reads_last_use_from_the_gateways(operator_client, fleet, redis_conn, cp_keys):
    created = create(operator_client).json()
    redis_conn.hset(cp_keys.key_last_used, created["key_id"], "1767225600.5")
    detail = operator_client.get(f"{URL}{created['id']}/").json()
    assert detail["last_used_at"].startswith("2026-01-01T00:00:00")


def test_it_is_in_the_openapi_schema(operator_client):
    schema = operator_client.get("/api/schema/", HTTP_ACCEPT="application/json").json()
    assert "/api/v1/client-keys/" in schema["paths"]
    assert "/api/v1/client-keys/{id}/rotate/" in schema["paths"]


def test_a_rolled_back_key_change_does_not_silence_later_ones(fleet, redis_conn, cp_keys):
    with pytest.raises(RuntimeError), transaction.atomic():
        doomed = ClientKey(name="doomed", owner="ana")
        doomed.set_new_secret()
        doomed.save()
        raise RuntimeError("the rest of the change failed")

    kept = ClientKey(name="kept", owner="ana")
    kept.set_new_secret()
    kept.save()

    assert [spec.id for spec in key_set(redis_conn, cp_keys).keys] == [kept.key_id]


@pytest.mark.parametrize("action", ["revoke", "rotate"])
def test_an_edit_never_undoes_a_revoke_or_rotate_made_meanwhile(
    operator_client, operator, fleet, monkeypatch, redis_conn, cp_keys, action
):
    """An operator changes a key's limit while another revokes it (or rotates its leaked secret).
    The edit saved the whole row as it had loaded it: the key was live again (or the old secret
    worked again and the new one did not), in the database and on every gateway."""
    created = create(operator_client).json()
    edited, acted = edit_racing(
        monkeypatch,
        ClientKeySerializer,
        lambda: operator_client.patch(f"{URL}{created['id']}/", {"requests_per_min": 5}, format="json"),
        lambda: client_for(operator.token).post(f"{URL}{created['id']}/{action}/"),
    )
    assert (edited.status_code, acted.status_code) == (200, 200), (edited.content, acted.content)
    key = ClientKey.objects.get(pk=created["id"])
    assert key.requests_per_min == 5
    if action == "revoke":
        assert key.revoked and key.revoked_at is not None
    else:
        assert key.secret_sha256 == hashlib.sha256(acted.json()["secret"].encode()).hexdigest()
    (live,) = key_set(redis_conn, cp_keys).keys
    assert (live.revoked, live.secret_sha256, live.requests_per_min) == (key.revoked, key.secret_sha256, 5)
