"""Failed sign-ins and bad API tokens are throttled per address: guessing gets ten tries."""

from __future__ import annotations

import pytest

from tests.controlplane.support import client_for

pytestmark = pytest.mark.django_db

LIMIT = 10


def test_bad_tokens_are_throttled_then_even_a_good_one_waits(operator, settings) -> None:
    assert settings.GORGO_AUTH_FAILURES == LIMIT
    guesser = client_for("0" * 40)
    for _ in range(LIMIT):
        assert guesser.get("/api/v1/regions/").status_code == 401
    refused = guesser.get("/api/v1/regions/")
    assert refused.status_code == 429
    assert int(refused["Retry-After"]) > 0
    assert client_for(operator.token).get("/api/v1/regions/").status_code == 429  # same address
    elsewhere = client_for(operator.token).get("/api/v1/regions/", REMOTE_ADDR="10.9.8.7")
    assert elsewhere.status_code == 200


@pytest.mark.parametrize("login_url", ["/login/", "/admin/login/"])
def test_thirty_wrong_passwords_then_the_right_one_is_refused(client, operator, login_url) -> None:
    for attempt in range(30):
        response = client.post(login_url, {"username": "op", "password": f"wrong-{attempt}"})
        assert response.status_code == 200  # the form again, with an error
    right = client.post(login_url, {"username": "op", "password": "operator-password-1"})
    assert right.status_code == 200, "signed in after 30 failures"
    assert "_auth_user_id" not in client.session
    # Another address is not affected.
    other = client.post(
        login_url, {"username": "op", "password": "operator-password-1"}, REMOTE_ADDR="10.9.8.7"
    )
    assert other.status_code == 302


def test_a_few_mistakes_do_not_lock_anyone_out(client, operator) -> None:
    for attempt in range(3):
        client.post("/login/", {"username": "op", "password": f"wrong-{attempt}"})
    assert client.post("/login/", {"username": "op", "password": "operator-password-1"}).status_code == 302
