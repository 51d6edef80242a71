"""A live gorgo stack for the deploy/ tests: control plane, one emulated vLLM node and a gateway,
each a real process on loopback, with a policy published through the API and a little traffic."""

from __future__ import annotations

from dataclasses import dataclass

from tests.e2e.test_control_plane_to_gateway import register_fleet
from tests.routing.support import MODEL
from tests.routing.test_e2e_gateway import client_for, start_fleet, start_gateway

NODE = "us-east-1"
REGION = "us-east"


@dataclass(frozen=True)
class Stack:
    control_plane_url: str
    gateway_url: str
    node_url: str


def start_stack(control_plane, processes, redis_url, redis_keys) -> Stack:
    urls = start_fleet(processes, names=(NODE,))
    with control_plane.api() as api:
        register_fleet(api, urls)
        policy = api.post("/policies/", json={"name": "default", "algorithm": "round_robin"})
        assert policy.status_code == 201, policy.text
        published = api.post(f"/policies/{policy.json()['id']}/publish/", json={"note": "first"})
        assert published.status_code == 201, published.text
    gateway = start_gateway(processes, redis_url, redis_keys)
    return Stack(control_plane.url, gateway, urls[NODE])


def send_traffic(stack: Stack, requests: int = 2) -> None:
    """A few plain and streamed requests, so labelled series and histogram buckets exist."""
    client = client_for(stack.gateway_url)
    for index in range(requests):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"hi {index}"}], max_tokens=4
        )
        list(client.completions.create(model=MODEL, prompt=f"stream {index}", max_tokens=4, stream=True))
