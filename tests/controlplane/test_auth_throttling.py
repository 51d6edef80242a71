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


def test_x_forwarded_for_counts_only_from_a_configured_proxy(operator, settings) -> None:
    """A guesser naming a new address per request in X-Forwarded-For is throttled all the same,
    unless its peer is a proxy the operator listed; through one, the hop the proxy saw counts."""
    guesser = client_for("0" * 40)
    for index in range(LIMIT):
        spoofed = guesser.get("/api/v1/regions/", HTTP_X_FORWARDED_FOR=f"203.0.113.{index}")
        assert spoofed.status_code == 401
    assert guesser.get("/api/v1/regions/", HTTP_X_FORWARDED_FOR="203.0.113.99").status_code == 429

    import ipaddress

    settings.GORGO_TRUSTED_PROXIES = (ipaddress.ip_network("10.0.0.0/8"),)
    behind = {"REMOTE_ADDR": "10.1.2.3"}
    # The proxy appended the address it saw (198.51.100.7); the left part is the client's own word.
    for index in range(LIMIT):
        forwarded = f"1.2.3.{index}, 198.51.100.7"
        assert guesser.get("/api/v1/regions/", HTTP_X_FORWARDED_FOR=forwarded, **behind).status_code == 401
    assert (
        guesser.get("/api/v1/regions/", HTTP_X_FORWARDED_FOR="9.9.9.9, 198.51.100.7", **behind).status_code
        == 429
    )
    other_client = client_for(operator.token).get(
        "/api/v1/regions/", HTTP_X_FORWARDED_FOR="198.51.100.8", **behind
    )
    assert other_client.status_code == 200


class HungRedis:
    """What a SIGSTOPped Redis does to a client: every call waits out the timeout, then fails."""

    def __init__(self) -> None:
        self.calls = 0

    def get(self, key):
        import redis

        self.calls += 1
        raise redis.TimeoutError("Timeout reading from socket")


def test_a_hung_redis_costs_one_timeout_per_backoff_and_one_warning_per_outage(
    operator, monkeypatch, caplog
) -> None:
    """Redis SIGSTOPped: every API call read the throttle counter and waited out the 2 s timeout,
    logging a warning each time. Now a failure makes the request path skip Redis for the back-off;
    one warning per outage, one line when it answers again."""
    from controlplane import connections, throttling

    clock = [1000.0]
    backoff = connections.RequestPathBackoff(5.0, clock=lambda: clock[0])
    monkeypatch.setattr(throttling, "request_path_backoff", lambda: backoff)
    hung = HungRedis()
    monkeypatch.setattr(throttling, "redis_client", lambda: hung)
    api = client_for(operator.token)
    caplog.set_level("INFO", logger="controlplane.connections")

    for _ in range(10):
        assert api.get("/api/v1/regions/").status_code == 200
    assert hung.calls == 1
    clock[0] += 5.0  # the back-off is over: one request tries again, still the same outage
    for _ in range(10):
        assert api.get("/api/v1/regions/").status_code == 200
    assert hung.calls == 2
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "Redis unreachable" in warnings[0].getMessage()

    monkeypatch.setattr(throttling, "redis_client", connections.redis_client)  # Redis is back
    clock[0] += 5.0
    assert api.get("/api/v1/regions/").status_code == 200
    assert backoff.down is False
    assert any("reachable again" in r.getMessage() for r in caplog.records)
