"""simulator/tcp_delay.py: Redis through the delay proxy answers correctly, in order, in both directions."""

from __future__ import annotations

import asyncio
import uuid
from urllib.parse import urlparse

import pytest
from redis.asyncio import Redis

from simulator.tcp_delay import TcpDelayProxy


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
