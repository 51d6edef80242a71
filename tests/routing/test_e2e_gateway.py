"""End to end: emulated vLLM nodes and the gateway as real processes, real Redis, the openai client.

Every node runs in its own ``python -m simulator --only NODE`` process so a test can kill one; the
gateway is ``python -m routing``. The policy is published to Redis the way the control plane does.
"""

from __future__ import annotations

import re
import signal
import sys
import time

import httpx
import openai
import pytest
import redis

from routing.contract import LeastLoadParams, RedisKeys
from routing.writer import write as write_snapshot
from simulator.harness import wait_until
from tests.routing.support import MODEL, make_node, make_snapshot
from tests.routing.test_redis_outage import PrivateRedis

pytestmark = pytest.mark.e2e

TIME_SCALE = "0.2"  # emulated WAN and GPU time run 5x faster
NODES = {"us-east-1": (1, "us-east"), "us-east-2": (2, "us-east"), "eu-central-1": (3, "eu-central")}
MESSAGES = [{"role": "user", "content": "Tell me about routing."}]


def start_fleet(processes, names=tuple(NODES)) -> dict[str, str]:
    """One simulator process per node; returns node name -> URL."""
    urls = {}
    for name in names:
        process = processes.start(
            name,
            [sys.executable, "-m", "simulator", "--only", name, "--auto-ports", "--time-scale", TIME_SCALE],
            ready_text="simulator ready",
        )
        match = re.search(rf"^{re.escape(name)}\s+\S+\s+(http://\S+)$", process.log(), re.MULTILINE)
        assert match, process.log()
        urls[name] = match.group(1)
    return urls


def publish_policy(
    redis_url: str, keys: RedisKeys, urls: dict[str, str], version: int, draining: tuple[str, ...] = ()
) -> None:
    nodes = tuple(
        make_node(
            node_id, urls[name], name=name, region=region, state="draining" if name in draining else "active"
        )
        for name, (node_id, region) in NODES.items()
        if name in urls
    )
    snapshot = make_snapshot(nodes, version=version, params=LeastLoadParams())
    client = redis.Redis.from_url(redis_url)
    try:
        assert write_snapshot(client, keys, snapshot), "Redis holds a newer snapshot"
    finally:
        client.close()


def start_gateway(
    processes, redis_url: str, keys: RedisKeys, name: str = "gateway", env: dict[str, str] | None = None
) -> str:
    process = processes.start(
        name,
        [sys.executable, "-m", "routing", "--region", "us-east", "--port", "0"],
        # Auth off, explicitly: these tests are about routing (tests/e2e/test_client_keys.py: keys).
        env={
            "REDIS_URL": redis_url,
            "GORGO_REDIS_PREFIX": keys.prefix,
            "LOG_LEVEL": "info",
            "GORGO_AUTH": "off",
            **(env or {}),
        },
        ready_text="listening on http:",
    )
    port = re.search(r"listening on http://127\.0\.0\.1:(\d+)", process.log()).group(1)
    return f"http://127.0.0.1:{port}"


def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)


def chat_node(client: openai.OpenAI) -> str:
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    assert raw.status_code == 200
    return raw.headers["x-gorgo-node"]


def policy_version(client: openai.OpenAI) -> str:
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    return raw.headers["x-gorgo-policy-version"]


class TestGatewayEndToEnd:
    def test_it_serves_chat_and_completions_streaming_and_not(self, redis_keys, redis_url, processes):
        urls = start_fleet(processes)
        publish_policy(redis_url, redis_keys, urls, version=1)
        client = client_for(start_gateway(processes, redis_url, redis_keys))

        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=8)
        assert raw.headers["x-gorgo-node"] in NODES
        assert raw.parse().choices[0].message.content
        assert raw.parse().usage.prompt_tokens > 0
        completion = client.completions.create(model=MODEL, prompt="The gateway", max_tokens=8)
        assert completion.choices[0].text
        stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, stream=True)
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        stream = client.completions.create(model=MODEL, prompt="The gateway", max_tokens=8, stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        assert [m.id for m in client.models.list()] == [MODEL]

    def test_it_streams_tokens_as_the_node_makes_them(self, redis_keys, redis_url, processes):
        urls = start_fleet(processes, ("us-east-1",))
        publish_policy(redis_url, redis_keys, urls, version=1)
        client = client_for(start_gateway(processes, redis_url, redis_keys))
        arrivals = []
        stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, stream=True)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                arrivals.append(time.perf_counter())
        assert len(arrivals) >= 10
        # each decode step takes emulated GPU time; a buffered stream would arrive all at once
        assert arrivals[-1] - arrivals[0] >= 0.010

    def test_it_follows_a_republished_policy_without_restart(self, redis_keys, redis_url, processes):
        urls = start_fleet(processes, ("us-east-1", "us-east-2"))
        publish_policy(redis_url, redis_keys, urls, version=1)
        client = client_for(start_gateway(processes, redis_url, redis_keys))
        assert {chat_node(client) for _ in range(6)} == {"us-east-1", "us-east-2"}

        publish_policy(redis_url, redis_keys, urls, version=2, draining=("us-east-1",))
        wait_until(lambda: policy_version(client) == "2", 10, what="the gateway on version 2")
        assert {chat_node(client) for _ in range(6)} == {"us-east-2"}

    def test_it_keeps_serving_while_redis_is_down(self, private_redis_server, processes):
        keys = RedisKeys(prefix="gorgo")
        urls = start_fleet(processes, ("us-east-1",))
        publish_policy(private_redis_server.url, keys, urls, version=1)
        gateway = start_gateway(processes, private_redis_server.url, keys)
        client = client_for(gateway)
        assert chat_node(client) == "us-east-1"
        private_redis_server.stop()
        wait_until(
            lambda: httpx.get(f"{gateway}/healthz").json()["redis_connected"] is False,
            10,
            what="the gateway seeing Redis gone",
        )
        for _ in range(5):
            assert chat_node(client) == "us-east-1"
        health = httpx.get(f"{gateway}/healthz")
        assert health.status_code == 200 and health.json()["policy_version"] == 1

    def test_it_routes_around_a_killed_node(self, redis_keys, redis_url, processes):
        urls = start_fleet(processes, ("us-east-1", "us-east-2"))
        publish_policy(redis_url, redis_keys, urls, version=1)
        client = client_for(start_gateway(processes, redis_url, redis_keys))
        assert {chat_node(client) for _ in range(6)} == {"us-east-1", "us-east-2"}

        processes.stop("us-east-1", sig=signal.SIGKILL)
        served = [chat_node(client) for _ in range(8)]  # every request succeeds
        assert set(served) == {"us-east-2"}


@pytest.fixture
def private_redis_server():
    """A private redis-server this test may stop (never the shared one)."""
    server = PrivateRedis()
    server.start()
    yield server
    server.stop()
