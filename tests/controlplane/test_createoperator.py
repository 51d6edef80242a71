"""``manage.py createoperator`` makes an account whose printed token works against the API."""

from __future__ import annotations

from io import StringIO

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from rest_framework.authtoken.models import Token

from tests.controlplane.support import LLAMA, client_for


def run(*args: str) -> str:
    out = StringIO()
    call_command("createoperator", *args, stdout=out)
    return out.getvalue()


def test_it_creates_an_operator_whose_token_can_write(fleet) -> None:
    output = run("--username", "alice", "--password", "alice-password-1")
    token = Token.objects.get(user__username="alice").key
    assert f"API token: {token}" in output
    user = get_user_model().objects.get(username="alice")
    assert user.check_password("alice-password-1")
    assert user.is_staff
    assert list(user.groups.values_list("name", flat=True)) == ["operators"]
    body = {"name": "us-east-3", "region": "us-east", "base_url": "http://127.0.0.1:9200", "models": [LLAMA]}
    assert client_for(token).post("/api/v1/nodes/", body, format="json").status_code == 201


def test_it_prints_only_the_token_at_verbosity_zero(db) -> None:
    output = run("--username", "bob", "--password", "bob-password-1", "-v", "0")
    assert output.strip() == Token.objects.get(user__username="bob").key


def test_it_generates_a_password_once_and_keeps_it(db) -> None:
    first = run("--username", "carol")
    assert "Password: " in first
    password = first.split("Password: ")[1].split()[0]
    assert get_user_model().objects.get(username="carol").check_password(password)
    second = run("--username", "carol")
    assert "Password: " not in second
    assert get_user_model().objects.get(username="carol").check_password(password)
    assert first.split("API token: ")[1].split()[0] == second.split("API token: ")[1].split()[0]


def test_it_takes_the_password_from_the_environment(db, monkeypatch) -> None:
    monkeypatch.setenv("GORGO_OPERATOR_PASSWORD", "from-the-env-1")
    output = run("--username", "dave")
    assert "Password: " not in output
    assert get_user_model().objects.get(username="dave").check_password("from-the-env-1")


def test_it_makes_a_viewer_that_cannot_write(fleet) -> None:
    run("--username", "erin", "--password", "erin-password-1")
    run("--username", "erin", "--viewer")
    user = get_user_model().objects.get(username="erin")
    assert list(user.groups.values_list("name", flat=True)) == ["viewers"]
    assert user.check_password("erin-password-1")
    client = client_for(Token.objects.get(user=user).key)
    assert client.get("/api/v1/nodes/").status_code == 200
    node = fleet.nodes["us-east-1"]
    assert client.post(f"/api/v1/nodes/{node.pk}/drain/").status_code == 403


def test_it_refuses_a_weak_password(db) -> None:
    with pytest.raises(CommandError, match="Password rejected"):
        run("--username", "frank", "--password", "short")
    assert not get_user_model().objects.filter(username="frank").exists()
