"""Every page: anonymous users go to the login page; signed-in users get the page with its data."""

from __future__ import annotations

import json
import time

import pytest
import redis
from django.test import Client

from controlplane.connections import redis_client
from controlplane.policies.models import RoutingPolicy
from routing import contract
from routing.contract import NodeLiveState, RedisKeys, RTTEntry, RTTTable
from simulator.harness import free_port
from tests.dashboard.conftest import Fleet

PAGES = ["/", "/breakdown/", "/cache/", "/nodes/", "/policies/", "/keys/"]


def page_data(response) -> dict:
    html = response.content.decode()
    start = html.index('<script id="gorgo-page" type="application/json">') + len(
        '<script id="gorgo-page" type="application/json">'
    )
    return json.loads(html[start : html.index("</script>", start)])


@pytest.mark.django_db
@pytest.mark.parametrize("path", [*PAGES, "/policies/new/", "/policies/{id}/", "/policies/{id}/edit/"])
def test_it_redirects_anonymous_users_to_the_login_page(
    client: Client, policy: RoutingPolicy, path: str
) -> None:
    url = path.format(id=policy.pk)
    response = client.get(url)
    assert response.status_code == 302
    assert response["Location"] == f"/login/?next={url}"


@pytest.mark.django_db
@pytest.mark.parametrize("path", PAGES)
def test_it_renders_every_page_for_a_viewer(viewer_client: Client, fleet: Fleet, path: str) -> None:
    response = viewer_client.get(path)
    assert response.status_code == 200
    data = page_data(response)
    assert [r["slug"] for r in data["fleet"]["regions"]] == ["ap-south", "eu-central", "us-east"]
    assert len(data["fleet"]["nodes"]) == 6
    assert b'aria-current="page"' in response.content


@pytest.mark.django_db
def test_it_logs_in_and_out(client: Client, operator) -> None:
    response = client.post("/login/", {"username": "op", "password": "operator-password-1"})
    assert response.status_code == 302 and response["Location"] == "/"
    assert client.get("/").status_code == 200
    assert client.post("/logout/").status_code == 302
    assert client.get("/").status_code == 302


@pytest.mark.django_db
def test_it_refuses_a_wrong_password_with_a_message(client: Client, operator) -> None:
    response = client.post("/login/", {"username": "op", "password": "wrong"})
    assert response.status_code == 200
    assert b"Please enter a correct username and password" in response.content


@pytest.mark.django_db
def test_it_embeds_the_live_state_the_workers_wrote(
    viewer_client: Client, fleet: Fleet, redis_conn: redis.Redis, cp_keys: RedisKeys
) -> None:
    node = fleet.nodes["eu-central-1"]
    now = time.time()
    state = NodeLiveState(
        schema_version=contract.SCHEMA_VERSION,
        node_id=node.pk,
        healthy=True,
        updated_at=now,
        num_running=7,
        num_waiting=2,
        kv_cache_usage=0.42,
        prefix_hit_rate=0.8,
        last_scrape_at=now,
    )
    redis_conn.hset(cp_keys.live_nodes, str(node.pk), contract.encode(state))
    table = RTTTable(
        schema_version=contract.SCHEMA_VERSION,
        updated_at=now,
        entries=(
            RTTEntry(
                region="us-east", node_id=node.pk, rtt_ms=88.5, jitter_ms=2.0, samples=9, updated_at=now
            ),
        ),
    )
    redis_conn.set(cp_keys.live_rtt, contract.encode(table))

    data = page_data(viewer_client.get("/nodes/"))

    live = data["live"]["nodes"][str(node.pk)]
    assert (live["num_running"], live["kv_cache_usage"], live["health"]) == (7, 0.42, "unknown")
    assert data["live"]["rtt"] == [
        {
            "region": "us-east",
            "node_id": node.pk,
            "rtt_ms": 88.5,
            "jitter_ms": 2.0,
            "samples": 9,
            "updated_at": now,
        }
    ]


@pytest.mark.django_db
def test_it_still_renders_with_redis_unreachable_and_says_so(
    viewer_client: Client, fleet: Fleet, settings
) -> None:
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"
    redis_client.cache_clear()
    response = viewer_client.get("/nodes/")
    assert response.status_code == 200
    assert b"Live state unavailable (Redis unreachable)" in response.content
    assert page_data(response)["live"]["nodes"] == {}


@pytest.mark.django_db
def test_it_shows_the_active_policy_in_the_overview_headline(
    viewer_client: Client, policy: RoutingPolicy, operator
) -> None:
    from controlplane.policies.publishing import publish

    publish(policy, author=operator.user, note="first")
    data = page_data(viewer_client.get("/"))
    assert data["policy"]["name"] == "default"
    assert data["policy"]["version"] == 1
    assert data["policy"]["author"] == "op"


@pytest.mark.django_db
def test_it_shows_an_empty_state_instead_of_blank_charts(viewer_client: Client, fleet: Fleet) -> None:
    content = viewer_client.get("/breakdown/").content.decode()
    assert "No traffic in this window" in content
    content = viewer_client.get("/").content.decode()
    assert "No RTT probes yet" in content
