"""Token auth for automation, session auth for the browser; groups decide who may write."""

from __future__ import annotations

import runpy
from pathlib import Path

from django.contrib.auth.models import Group

from controlplane.accounts import OPERATORS, VIEWERS, sync_groups
from tests.controlplane.support import client_for


def test_it_accepts_a_valid_token_and_refuses_a_bad_one(operator, fleet) -> None:
    response = client_for(operator.token).get("/api/v1/nodes/")
    assert response.status_code == 200
    assert response.json()["count"] == 6
    assert client_for("not-a-token").get("/api/v1/nodes/").status_code == 401
    assert client_for(None).get("/api/v1/nodes/").status_code == 401


def test_it_accepts_a_browser_session(client, viewer, fleet) -> None:
    assert client.get("/api/v1/regions/").status_code in (401, 403)
    client.force_login(viewer.user)
    assert client.get("/api/v1/regions/").json()["count"] == 3


def test_it_gives_operators_every_fleet_and_policy_permission_and_viewers_only_views(db) -> None:
    sync_groups()
    operators = set(
        Group.objects.get(name=OPERATORS).permissions.values_list("content_type__app_label", "codename")
    )
    viewers = set(
        Group.objects.get(name=VIEWERS).permissions.values_list("content_type__app_label", "codename")
    )
    for app, model in [
        ("fleet", "region"),
        ("fleet", "llmmodel"),
        ("fleet", "node"),
        ("policies", "routingpolicy"),
    ]:
        for action in ("add", "change", "delete", "view"):
            assert (app, f"{action}_{model}") in operators
        assert (app, f"view_{model}") in viewers
    assert ("policies", "publish_routingpolicy") in operators
    assert all(codename.startswith("view_") for _, codename in viewers)


def test_it_makes_the_groups_in_a_migration(db) -> None:
    # The test database is built by the migrations; no call to sync_groups here.
    assert Group.objects.get(name=OPERATORS).permissions.filter(codename="publish_routingpolicy").exists()
    assert Group.objects.get(name=VIEWERS).permissions.filter(codename="view_node").exists()


def _settings_with(monkeypatch, **env: str) -> dict:
    """controlplane/settings.py as a process started with ``env`` would read it."""
    monkeypatch.setenv("SECRET_KEY", "k" * 50)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return runpy.run_path(str(Path(__file__).resolve().parents[2] / "controlplane" / "settings.py"))


def test_it_marks_the_session_and_csrf_cookies_secure_when_served_over_https(monkeypatch) -> None:
    # Behind the HTTPS load balancer of docs/deployment.md the session cookie must never travel
    # over plain HTTP (a typed http:// address, a redirect on port 80): a sniffer would sign in.
    monkeypatch.delenv("GORGO_SECURE_COOKIES", raising=False)
    plain = _settings_with(monkeypatch)
    assert (plain["SESSION_COOKIE_SECURE"], plain["CSRF_COOKIE_SECURE"]) == (False, False)  # make run: http
    https = _settings_with(monkeypatch, GORGO_SECURE_COOKIES="true")
    assert (https["SESSION_COOKIE_SECURE"], https["CSRF_COOKIE_SECURE"]) == (True, True)
