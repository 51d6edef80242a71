"""``python -m routing --workers 2``: two gateway processes on one port, sharing in-flight state.

Each worker is a gateway of its own (its id ends with its pid, its own metrics); what one has in
flight reaches the other through the load exchange in Redis, as between separate gateways, so
admission and least-load decisions count both.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import sys
import time

import pytest
import redis

from routing.contract import SCHEMA_VERSION, ClientKeySet, GatewayLoad, decode
from routing.writer import write
from simulator.harness import free_port, wait_until
from tests.routing.support import make_key, make_node, make_snapshot
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
        ready_text="listening on http:",
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


RATE_SECRET = "gorgo-sk-rate-two-workers"
CONCURRENT_SECRET = "gorgo-sk-conc-two-workers"
OPEN_SECRET = "gorgo-sk-open-two-workers"  # no limits: the drain check is not about them


def keyed_requests(port: int, secret: str, count: int, payload: bytes) -> list[int]:
    """``count`` requests with ``secret``, all sent at once, each on its own new connection (so
    the kernel spreads them over both workers); their statuses."""
    socks = [socket.create_connection(("127.0.0.1", port), timeout=20) for _ in range(count)]
    for sock in socks:
        sock.sendall(request(payload, b"Authorization: Bearer " + secret.encode()))
    statuses = [Reader(sock).read()[0].status for sock in socks]
    for sock in socks:
        sock.close()
    return statuses


def test_two_workers_admit_exactly_a_keys_limits_and_drain_on_sigterm(redis_keys, redis_url, processes):
    """Each worker is a gateway of its own; a key's limits hold across them, exactly: no more (the
    shared buckets and slot leases in Redis) and, with both busy, no fewer. Then SIGTERM to the
    parent alone (as an orchestrator sends it): it forwards it; the worker with a stream under way
    stops accepting but finishes the stream (to its [DONE]), and the parent exits 0 once both are
    done. (One test: a gateway with two workers takes seconds to start on a busy machine.)"""
    upstream_process = processes.start(
        "upstream", [sys.executable, "-m", "tests.routing.http_upstream"], ready_text="READY"
    )
    upstream_port = re.search(r"READY (\d+)", upstream_process.log()).group(1)
    upstream = f"http://127.0.0.1:{upstream_port}"
    client = redis.Redis.from_url(redis_url)
    write(client, redis_keys, make_snapshot((make_node(1, upstream),)))
    keys = (
        make_key(RATE_SECRET, "rate", requests_per_min=10),
        make_key(CONCURRENT_SECRET, "conc", max_concurrent=3),
        make_key(OPEN_SECRET, "open"),
    )
    write(client, redis_keys, ClientKeySet(SCHEMA_VERSION, 1, time.time(), keys))
    processes.start(
        "gateway",
        [sys.executable, "-m", "routing", "--region", "us-east", "--port", "0", "--workers", "2"],
        env={
            "REDIS_URL": redis_url,
            "GORGO_REDIS_PREFIX": redis_keys.prefix,
            "GORGO_AUTH": "on",
            "GORGO_GATEWAY_ID": "gw",
            "LOG_LEVEL": "info",
        },
        ready_text="listening on http:",
    )
    gateway = processes.processes["gateway"]
    wait_until(lambda: gateway.log().count("listening on http:") == 2, 20.0, what="both workers")
    port = int(re.search(r"listening on http://127\.0\.0\.1:(\d+)", gateway.log()).group(1))

    rate = keyed_requests(port, RATE_SECRET, 24, body())
    assert sorted(rate) == [200] * 10 + [429] * 14, rate

    # Streams of ~2 s, all open at once: three slots in the fleet, whichever worker holds them.
    concurrent = keyed_requests(
        port, CONCURRENT_SECRET, 16, body({"events": 40, "chunk_delay_s": 0.05}, stream=True)
    )
    assert sorted(concurrent) == [200] * 3 + [429] * 13, concurrent
    pids = {int(pid) for pid in re.findall(r"listening on http://\S+ \(pid (\d+)\)", gateway.log())}
    served = {
        json.loads(fields[b"r"])["gateway_id"] for _, fields in client.xrange(redis_keys.request_stream)
    }
    assert served == {f"gw-{pid}" for pid in pids}  # both workers took requests
    client.close()

    sock = socket.create_connection(("127.0.0.1", port), timeout=20)
    stream = body({"events": 30, "chunk_delay_s": 0.05}, stream=True)
    sock.sendall(request(stream, b"Authorization: Bearer " + OPEN_SECRET.encode()))
    reader = Reader(sock)
    sock.settimeout(20)
    first = sock.recv(65536)
    assert first.startswith(b"HTTP/1.1 200"), first[:200]
    gateway.popen.send_signal(signal.SIGTERM)  # the parent only
    reader._parser.feed_data(first)
    (answer,) = reader.read()
    assert answer.status == 200 and answer.body.endswith(b"data: [DONE]\n\n")
    assert sock.recv(65536) == b""  # then the stopping worker closes the connection
    sock.close()
    assert gateway.popen.wait(20) == 0
