"""A live gorgo stack for the deploy/ tests: control plane, one emulated vLLM node and a gateway
with its front door on, each a real process on loopback, a policy published and a client key made
through the API, and a little traffic."""

from __future__ import annotations

from dataclasses import dataclass

import openai

from simulator.harness import wait_until
from tests.e2e.test_control_plane_to_gateway import register_fleet
from tests.routing.support import MODEL
from tests.routing.test_e2e_gateway import start_fleet, start_gateway

NODE = "us-east-1"
REGION = "us-east"


@dataclass(frozen=True)
class Stack:
    control_plane_url: str
    gateway_url: str
    node_url: str
    key: str


def start_stack(control_plane, processes, redis_url, redis_keys) -> Stack:
    urls = start_fleet(processes, names=(NODE,))
    with control_plane.api() as api:
        register_fleet(api, urls)
        policy = api.post("/policies/", json={"name": "default", "algorithm": "round_robin"})
        assert policy.status_code == 201, policy.text
        published = api.post(f"/policies/{policy.json()['id']}/publish/", json={"note": "first"})
        assert published.status_code == 201, published.text
        created = api.post(
            "/client-keys/", json={"name": "deploy-tests", "owner": "tests", "models": [MODEL]}
        )
        assert created.status_code == 201, created.text
    # The front door on, so its metrics (keys, limits, queue, breakers) are exported too.
    gateway = start_gateway(processes, redis_url, redis_keys, env={"GORGO_AUTH": "on"})
    stack = Stack(control_plane.url, gateway, urls[NODE], created.json()["secret"])
    wait_until(lambda: _served(stack), 10, what="the gateway accepting the new key", describe=processes.logs)
    return stack


def _client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key=stack.key, max_retries=0, timeout=30)


def _served(stack: Stack) -> bool:
    try:
        _client(stack).models.list()
    except openai.AuthenticationError:
        return False
    return True


def send_traffic(stack: Stack, requests: int = 2) -> None:
    """A few plain and streamed requests, so labelled series and histogram buckets exist."""
    client = _client(stack)
    for index in range(requests):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"hi {index}"}], max_tokens=4
        )
        list(client.completions.create(model=MODEL, prompt=f"stream {index}", max_tokens=4, stream=True))
