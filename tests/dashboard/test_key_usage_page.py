"""The Key usage page (/keys/usage/): per-key and per-team figures from the gateways' request log."""

from __future__ import annotations

import json
import math
import re
import time

import pytest
from django.test import Client

from controlplane.connections import redis_client, redis_keys
from controlplane.dashboard import series
from controlplane.keys.models import ClientKey
from routing import contract
from routing.contract import REQUEST_STREAM_FIELD
from telemetry.aggregation import run_round
from tests.dashboard.conftest import Fleet
from tests.telemetry.test_request_aggregation import record

pytestmark = pytest.mark.django_db

T0 = math.floor(time.time() / 60) * 60 - 120.0  # two complete minutes ago: inside every window


def make_key(name: str, team: str, priority: str = "interactive") -> tuple[ClientKey, str]:
    key = ClientKey(name=name, owner="ana", team=team, priority=priority)
    secret = key.set_new_secret()
    key.save()
    return key, secret


@pytest.fixture
def traffic(fleet: Fleet):
    """Two teams' keys' requests, through the request stream and the telemetry aggregation."""
    node = fleet.nodes["us-east-1"]
    search, search_secret = make_key("search", "retrieval")
    chat, _ = make_key("chat <b>", "retrieval")
    nightly, _ = make_key("nightly", "analytics", priority="batch")
    rows = [
        *(
            record(
                node,
                ts=T0 + i,
                ttft_ms=100.0 + i,
                completion_tokens=10,
                key_id=search.key_id,
                priority="interactive",
            )
            for i in range(6)
        ),
        record(
            node,
            ts=T0 + 7,
            ttft_ms=None,
            status=429,
            prompt_tokens=None,
            key_id=search.key_id,
            priority="interactive",
        ),
        record(
            node, ts=T0 + 8, ttft_ms=300.0, completion_tokens=40, key_id=chat.key_id, priority="interactive"
        ),
        record(
            node,
            ts=T0 + 9,
            ttft_ms=None,
            status=503,
            error="no capacity",
            key_id=nightly.key_id,
            priority="batch",
        ),
        record(node, ts=T0 + 9, ttft_ms=90.0),  # no key: not anyone's usage
    ]
    client, keys = redis_client(), redis_keys()
    for row in rows:
        client.xadd(keys.request_stream, {REQUEST_STREAM_FIELD: contract.encode(row)})
    assert run_round(client, keys).added == len(rows)
    return {"search": search, "chat": chat, "nightly": nightly, "secret": search_secret}


def window(key: str) -> series.Window:
    return {
        "15m": series.Window.of("15m", 900, "10s"),
        "1h": series.Window.of("1h", 3600, "1m"),
        "24h": series.Window.of("24h", 86400, "1m"),
    }[key]


@pytest.mark.parametrize("key", ["15m", "1h", "24h"])
def test_it_sums_each_key_and_team_over_the_window(traffic, key, django_assert_num_queries):
    with django_assert_num_queries(2):  # the buckets, the keys' names: not one per key
        data = series.key_usage(window(key))

    keys = {k["key_id"]: k for k in data["keys"]}
    search = keys[traffic["search"].key_id]
    assert (search["name"], search["team"], search["priorities"]) == ("search", "retrieval", ["interactive"])
    assert (search["count"], search["errors_4xx"], search["errors_5xx"], search["limited"]) == (7, 1, 0, 1)
    assert (search["completion_tokens"], search["ttft_count"]) == (60, 6)
    assert search["ttft_p50_ms"] == pytest.approx(102.5, rel=0.03)
    assert keys[traffic["nightly"].key_id]["errors_5xx"] == 1
    teams = {t["team"]: t for t in data["teams"]}
    assert (teams["retrieval"]["keys"], teams["retrieval"]["count"]) == (2, 8)
    assert teams["retrieval"]["completion_tokens"] == 100
    assert teams["retrieval"]["ttft_p99_ms"] == pytest.approx(300.0, rel=0.03)
    assert (teams["analytics"]["count"], teams["analytics"]["error_rate"]) == (1, 1.0)
    assert sum(p["count"] for p in data["series"]["retrieval"]) == 8
    assert [t["team"] for t in data["teams"]] == ["retrieval", "analytics"]  # busiest first


def test_a_deleted_key_keeps_its_usage_without_a_name(traffic):
    key_id = traffic["nightly"].key_id
    traffic["nightly"].delete()

    data = series.key_usage(window("1h"))

    assert [(k["name"], k["team"]) for k in data["keys"] if k["key_id"] == key_id] == [(None, "analytics")]


def test_a_viewer_sees_the_page_with_the_usage_and_no_secret(viewer_client: Client, traffic):
    response = viewer_client.get("/keys/usage/?window=1h")

    assert response.status_code == 200
    html = response.content.decode()
    assert 'data-testid="key-usage-table"' in html and 'data-testid="team-table"' in html
    assert 'id="team-requests"' in html and 'id="key-tokens"' in html
    assert "gorgo/key-usage.js" in html
    embedded = json.loads(
        re.search(r'<script id="gorgo-page" type="application/json">(.*?)</script>', html, re.S)[1]
    )
    assert embedded["window"] == "1h" and embedded["urls"]["key_usage"] == "/data/key-usage/"
    assert {k["key_id"] for k in embedded["usage"]["keys"]} == {
        traffic[name].key_id for name in ("search", "chat", "nightly")
    }
    assert "chat <b>" not in html  # names reach the page only inside escaped JSON
    for key in ("search", "chat", "nightly"):
        assert traffic[key].secret_sha256 not in html
    assert traffic["secret"] not in html


def test_the_key_list_links_to_its_usage_tab(viewer_client: Client, fleet):
    html = viewer_client.get("/keys/").content.decode()

    assert 'href="/keys/usage/"' in html


def test_the_chart_data_follows_the_window(viewer_client: Client, traffic):
    response = viewer_client.get("/data/key-usage/?window=15m")

    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    body = response.json()
    assert body["window"] == "15m" and body["step_s"] == 10
    assert sum(k["count"] for k in body["keys"]) == 9
    assert traffic["secret"] not in response.content.decode()


def test_it_rejects_an_unknown_window_and_strangers(viewer_client: Client, client: Client):
    bad = viewer_client.get("/data/key-usage/?window=7d")

    assert bad.status_code == 400 and bad.json() == {"window": "Unknown window 7d; use one of 15m, 1h, 24h."}
    assert client.get("/data/key-usage/").status_code == 403
    assert client.get("/keys/usage/").status_code == 302  # to the sign-in page
