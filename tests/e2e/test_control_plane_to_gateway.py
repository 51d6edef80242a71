"""The whole path an operator uses: REST API -> publish -> Redis -> gateway -> emulated vLLM nodes.

The control plane, the gateway and each node run as real processes on loopback, sharing one Redis
namespace. Nothing is written to Redis by the test itself.
"""

from __future__ import annotations

import httpx
import pytest

from simulator.harness import wait_until
from tests.routing.support import MODEL
from tests.routing.test_e2e_gateway import chat_node, client_for, start_fleet, start_gateway

pytestmark = pytest.mark.e2e


def register_fleet(api: httpx.Client, urls: dict[str, str]) -> dict[str, int]:
    """Create the region, the model and the nodes through the API; return node name -> id."""
    assert (
        api.post(
            "/regions/", json={"slug": "us-east", "name": "US East", "latitude": 39.04, "longitude": -77.49}
        ).status_code
        == 201
    )
    assert (
        api.post(
            "/models/", json={"name": MODEL, "kv_block_size": 16, "max_context_tokens": 32768}
        ).status_code
        == 201
    )
    ids = {}
    for name, url in urls.items():
        response = api.post(
            "/nodes/", json={"name": name, "region": "us-east", "base_url": url, "models": [MODEL]}
        )
        assert response.status_code == 201, response.text
        ids[name] = response.json()["id"]
    return ids


def test_it_routes_by_what_the_api_publishes(control_plane, processes, redis_url, redis_keys) -> None:
    urls = start_fleet(processes, names=("us-east-1", "us-east-2"))
    with control_plane.api() as api:
        node_ids = register_fleet(api, urls)
        policy = api.post("/policies/", json={"name": "default", "algorithm": "round_robin", "params": {}})
        assert policy.status_code == 201, policy.text
        policy_id = policy.json()["id"]
        published = api.post(f"/policies/{policy_id}/publish/", json={"note": "first"})
        assert published.status_code == 201, published.text
        first_version = published.json()["number"]

        gateway = start_gateway(processes, redis_url, redis_keys)
        client = client_for(gateway)
        assert {chat_node(client) for _ in range(6)} == {"us-east-1", "us-east-2"}

        # Draining a node through the API republishes; the gateway stops sending to it, no restart.
        assert api.post(f"/nodes/{node_ids['us-east-1']}/drain/").status_code == 200
        wait_until(
            lambda: {chat_node(client) for _ in range(4)} == {"us-east-2"},
            10,
            what="routing around the drain",
        )

        # An invalid edit is refused with field errors, and what the gateway runs does not change.
        bad = api.patch(f"/policies/{policy_id}/", json={"algorithm": "gorgo", "params": {"w_rtt": -1}})
        assert bad.status_code == 400 and "params" in bad.json(), bad.text
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )
        live_version = int(raw.headers["x-gorgo-policy-version"])
        assert live_version > first_version

        # A valid algorithm change takes effect on publish: the gateway reports the new version.
        assert (
            api.patch(
                f"/policies/{policy_id}/", json={"algorithm": "gorgo", "params": {"w_rtt": 2.0}}
            ).status_code
            == 200
        )
        republished = api.post(f"/policies/{policy_id}/publish/", json={"note": "switch to gorgo"})
        assert republished.status_code == 201, republished.text
        new_version = republished.json()["number"]
        assert new_version > live_version

        def gateway_runs_new_version() -> bool:
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1
            )
            return int(raw.headers["x-gorgo-policy-version"]) == new_version

        wait_until(gateway_runs_new_version, 10, what="the gateway on the new version")
        metrics = httpx.get(f"{gateway}/metrics").text
        assert f"gorgo_gateway_policy_version {float(new_version)}" in metrics, metrics
