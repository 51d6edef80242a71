"""``python -m routing --workers 2``: two gateway processes on one port, sharing in-flight state.

Each worker is a gateway of its own (its id ends with its pid, its own metrics); what one has in
flight reaches the other through the load exchange in Redis, as between separate gateways, so
admission and least-load decisions count both.
"""

from __future__ import annotations

import json
import re
import socket
import sys

import pytest
import redis

from routing.contract import GatewayLoad, decode
from routing.writer import write
from simulator.harness import free_port, wait_until
from tests.routing.support import make_node, make_snapshot
from tests.routing.test_http11 import Reader, body, request

pytestmark = pytest.mark.e2e


def loads(client: redis.Redis, key: str) -> dict[str, GatewayLoad]:
    return {name.decode(): decode(raw, GatewayLoad) for name, raw in client.hgetall(key).items()}


def test_two_workers_serve_one_port_and_share_what_they_have_in_flight(redis_keys, redis_url, processes):
    upstream_process = processes.start(
        "upstream", [sys.executable, "-m", "tests.routing.http_upstream"], ready_text="READY"
    )
    port = re.search(r"READY (\d+)", upstream_process.log()).group(1)
    client = redis.Redis.from_url(redis_url)
    write(client, redis_keys, make_snapshot((make_node(1, f"http://127.0.0.1:{port}"),)))
    gateway_port = free_port()
    processes.start(
        "gateway",
        [
            sys.executable,
            "-m",
            "routing",
            "--region",
            "us-east",
            "--port",
            str(gateway_port),
            "--workers",
            "2",
        ],
        env={
            "REDIS_URL": redis_url,
            "GORGO_REDIS_PREFIX": redis_keys.prefix,
            "GORGO_AUTH": "off",
            "GORGO_GATEWAY_ID": "gw",
            "LOG_LEVEL": "info",
        },
        ready_text="Application startup complete",
    )
    # Both workers are up and exchanging their load under ids of their own.
    wait_until(lambda: len(loads(client, redis_keys.gateway_load)) == 2, 10.0, what="two workers")
    ids = set(loads(client, redis_keys.gateway_load))
    assert all(re.fullmatch(r"gw-\d+", gateway_id) for gateway_id in ids), ids

    # Requests on many connections are answered, whichever worker accepts them.
    for _ in range(10):
        with socket.create_connection(("127.0.0.1", gateway_port), timeout=10) as sock:
            sock.sendall(request(body()))
            (answer,) = Reader(sock).read()
            assert answer.status == 200

    # A long stream in flight on one worker shows in the shared load both workers read.
    sock = socket.create_connection(("127.0.0.1", gateway_port), timeout=10)
    sock.sendall(request(body({"events": 100, "chunk_delay_s": 0.05}, stream=True)))
    assert sock.recv(65536).startswith(b"HTTP/1.1 200")

    def busy() -> list[str]:
        return [
            gateway_id
            for gateway_id, load in loads(client, redis_keys.gateway_load).items()
            if load.outstanding_requests.get(1)
        ]

    wait_until(lambda: len(busy()) == 1, 5.0, what="the stream in the shared load")
    sock.close()
    wait_until(lambda: not busy(), 10.0, what="the stream's end in the shared load")

    # Each worker's request records carry its own id.
    records = client.xrange(redis_keys.request_stream)
    seen = {json.loads(fields[b"r"])["gateway_id"] for _, fields in records}
    assert seen <= ids and len(records) == 11
    client.close()
