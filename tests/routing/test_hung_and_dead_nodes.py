"""Hung and dead nodes, with real node processes (issue 12 repros).

- A hung node (SIGSTOP) stalled its streams silently for up to 600 s, and new requests kept going
  to it: now a started stream ends with the SSE error event after the idle timeout, a request
  that got no first byte fails over, and the circuit breaker keeps new requests away.
- A dead node was routed to again once its live entry went stale: now only the gateway's own
  probe (GET /health) may bring it back, never a client request.
"""

from __future__ import annotations

import re
import signal
import time

import httpx
import pytest
import redis

from routing.contract import SCHEMA_VERSION, NodeLiveState, encode
from tests.routing.support import MODEL
from tests.routing.test_e2e_gateway import MESSAGES, NODES, publish_policy, start_fleet, start_gateway

pytestmark = pytest.mark.e2e

FAST = {
    "GORGO_UPSTREAM_FIRST_BYTE_TIMEOUT_S": "1",
    "GORGO_UPSTREAM_IDLE_TIMEOUT_S": "1",
    "GORGO_NODE_DOWN_COOLDOWN_S": "1",
}


def stream_body(max_tokens: int) -> dict:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens, "stream": True}


def metric(gateway: str, name: str) -> float:
    text = httpx.get(f"{gateway}/metrics").text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


@pytest.fixture
def two_nodes(redis_keys, redis_url, processes):
    urls = start_fleet(processes, ("us-east-1", "us-east-2"))
    publish_policy(redis_url, redis_keys, urls, version=1)
    yield urls
    for name in urls:  # a stopped process must be resumed to be stopped
        process = processes.processes.get(name)
        if process is not None and process.alive():
            process.popen.send_signal(signal.SIGCONT)


class TestHungNode:
    def test_a_stream_from_a_node_that_hangs_ends_with_an_error_event(
        self, redis_keys, redis_url, processes, two_nodes
    ):
        gateway = start_gateway(processes, redis_url, redis_keys, env=FAST)
        with httpx.Client(base_url=gateway, timeout=30) as client:
            with client.stream("POST", "/v1/chat/completions", json=stream_body(2000)) as response:
                assert response.status_code == 200
                hung = response.headers["x-gorgo-node"]
                lines = response.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
                processes.processes[hung].popen.send_signal(signal.SIGSTOP)
                stopped_at = time.monotonic()
                rest = [line for line in lines if line.startswith("data: ")]
                ended_after_s = time.monotonic() - stopped_at
            assert '"error"' in rest[-1] and "mid-stream" in rest[-1]
            assert ended_after_s < 10  # the idle timeout is 1 s; before: up to 600 s of silence
            # New requests avoid the hung node (its breaker is open), without any telemetry.
            served = []
            for _ in range(6):
                answer = client.post("/v1/chat/completions", json=stream_body(4))
                served.append((answer.status_code, answer.headers.get("x-gorgo-node")))
        assert all(status == 200 and node != hung for status, node in served), served
        assert metric(gateway, 'gorgo_gateway_timeouts_total{kind="idle"}') == 1.0
        assert metric(gateway, f'gorgo_gateway_breaker_state{{node="{hung}"}}') in (1.0, 2.0)

    def test_a_request_without_a_first_byte_fails_over_before_the_client_sees_anything(
        self, redis_keys, redis_url, processes, two_nodes
    ):
        processes.processes["us-east-1"].popen.send_signal(signal.SIGSTOP)
        gateway = start_gateway(processes, redis_url, redis_keys, env=FAST)
        with httpx.Client(base_url=gateway, timeout=30) as client:
            answers = [client.post("/v1/chat/completions", json=stream_body(4)) for _ in range(6)]
        assert [(a.status_code, a.headers["x-gorgo-node"]) for a in answers] == [(200, "us-east-2")] * 6
        assert metric(gateway, 'gorgo_gateway_timeouts_total{kind="first_byte"}') == 1.0
        assert metric(gateway, 'gorgo_gateway_retries_total{reason="first_byte"}') == 1.0

    def test_a_non_streaming_request_to_a_hung_node_is_taken_back_after_a_failed_health_probe(
        self, redis_keys, redis_url, processes, two_nodes
    ):
        processes.processes["us-east-1"].popen.send_signal(signal.SIGSTOP)
        gateway = start_gateway(processes, redis_url, redis_keys, env=FAST)
        started = time.monotonic()
        with httpx.Client(base_url=gateway, timeout=60) as client:
            answers = [
                client.post("/v1/chat/completions", json={**stream_body(4), "stream": False})
                for _ in range(4)
            ]
        elapsed_s = time.monotonic() - started
        assert [(a.status_code, a.headers["x-gorgo-node"]) for a in answers] == [(200, "us-east-2")] * 4
        assert metric(gateway, 'gorgo_gateway_retries_total{reason="first_byte"}') == 1.0
        assert elapsed_s < 15  # first-byte timeout 1 s + a 2 s health probe; before: up to 600 s


class TestDeadNode:
    def test_a_dead_node_is_not_routed_to_again_when_its_live_state_goes_stale(
        self, redis_keys, redis_url, processes, two_nodes
    ):
        client = redis.Redis.from_url(redis_url)
        now = time.time()
        client.hset(
            redis_keys.live_nodes,
            mapping={
                str(node_id): encode(NodeLiveState(SCHEMA_VERSION, node_id, True, now))
                for node_id, _ in NODES.values()
            },
        )
        client.close()
        gateway = start_gateway(processes, redis_url, redis_keys, env={**FAST, "GORGO_LIVE_STALE_S": "1"})
        processes.stop("us-east-1", sig=signal.SIGKILL)
        statuses = []
        deadline = time.monotonic() + 4.0  # the live entry goes stale after 1 s; probes every 1-4 s
        with httpx.Client(base_url=gateway, timeout=30) as http:
            while time.monotonic() < deadline and len(statuses) < 200:
                answer = http.post("/v1/chat/completions", json={**stream_body(2), "stream": False})
                statuses.append(answer.status_code)
                time.sleep(0.05)
        assert set(statuses) == {200}
        # One client request found out (and was retried on us-east-2); none after, stale or not.
        assert metric(gateway, 'gorgo_gateway_upstream_errors_total{kind="connect",node="us-east-1"}') == 1.0
