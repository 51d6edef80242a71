"""simulator/tcp_delay.py: Redis through the delay proxy answers correctly, in order, in both directions."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import uuid
from urllib.parse import urlparse

import pytest
import redis
from redis.asyncio import Redis

from simulator.tcp_delay import TcpDelayProxy
from tests.conftest import ROOT


@pytest.mark.parametrize("rtt_ms", [0.0, 10.0])
async def test_redis_through_the_proxy_answers_every_command_in_order(redis_url, rtt_ms):
    proxy = TcpDelayProxy("127.0.0.1", urlparse(redis_url).port or 6379, rtt_ms=rtt_ms)
    port = await proxy.start()
    client = Redis.from_url(f"redis://127.0.0.1:{port}/0")
    name = f"gorgotest-tcpdelay-{uuid.uuid4().hex}"
    big = bytes(range(256)) * 1024  # 256 KiB: several chunks each way
    try:
        await client.set(name, big, ex=60)
        assert await client.get(name) == big
        pipe = client.pipeline(transaction=False)
        for index in range(50):
            pipe.echo(str(index))
        assert await pipe.execute() == [str(index).encode() for index in range(50)]
        answers = await asyncio.gather(*(client.echo(f"c{index}") for index in range(8)))
        assert answers == [f"c{index}".encode() for index in range(8)]
    finally:
        await client.delete(name)
        await client.aclose()
        await proxy.close()
    assert proxy.one_way_s == rtt_ms / 2000


def test_it_forwards_to_loopback_only():
    with pytest.raises(ValueError):
        TcpDelayProxy("10.0.0.1", 6379, rtt_ms=1.0)


def test_as_a_process_it_prints_one_port_per_round_trip_and_stops_on_sigterm(redis_url):
    # benchmarks/routing_quality.py --shared-state wan runs the proxies this way, one per region.
    upstream = f"127.0.0.1:{urlparse(redis_url).port or 6379}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "simulator.tcp_delay",
            "--upstream",
            upstream,
            "--rtt-ms",
            "0",
            "--rtt-ms",
            "4",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ports = json.loads(proc.stdout.readline())["ports"]
        assert len(ports) == 2
        for port in ports:
            client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5.0)
            try:
                assert client.ping()
            finally:
                client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
