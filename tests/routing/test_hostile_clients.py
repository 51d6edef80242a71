"""Careless and hostile clients against a real gateway process (issue 12 repros).

Before: a 64 MB header was buffered and forwarded (RSS +47 MB, kept), 1,000 headers likewise, and
50 slow-header, 50 slow-body and 50 idle connections were all still open after 100 s, with no cap
on connections. Now each is answered (431, 408, 503) or closed within its limit, RSS stays flat.
"""

from __future__ import annotations

import socket
import time

import pytest
import redis

from routing.writer import write
from tests.routing.support import make_node, make_snapshot
from tests.routing.test_e2e_gateway import start_gateway

pytestmark = pytest.mark.e2e

LIMITS = {
    "GORGO_AUTH": "off",
    "GORGO_CLIENT_HEADER_TIMEOUT_S": "1",
    "GORGO_CLIENT_BODY_TIMEOUT_S": "1",
    "GORGO_CLIENT_KEEPALIVE_S": "1",
    "GORGO_MAX_CONNECTIONS": "60",
}
HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"


@pytest.fixture
def gateway(redis_keys, redis_url, processes):
    client = redis.Redis.from_url(redis_url)
    write(client, redis_keys, make_snapshot((make_node(1, "http://127.0.0.1:9"),)))
    client.close()
    url = start_gateway(processes, redis_url, redis_keys, env=LIMITS)
    return url, processes.processes["gateway"].popen.pid


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def answer(sock: socket.socket) -> bytes:
    """What the server sent before closing (b'' if it closed without a word)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return data


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


class TestHostileClients:
    def test_an_oversized_header_is_refused_without_buffering_it(self, gateway):
        url, pid = gateway
        before = rss_kib(pid)
        for _ in range(3):
            sock = connect(url)
            sent = 0
            try:
                sock.sendall(HEAD + b"X-Big: ")
                chunk = b"a" * (1 << 20)
                while sent < 64 << 20:  # the repro: a 64 MB header
                    sock.sendall(chunk)
                    sent += len(chunk)
            except (BrokenPipeError, ConnectionResetError):
                pass
            reply = answer(sock)
            sock.close()
            assert sent < 16 << 20  # the gateway hung up long before 64 MB
            assert reply == b"" or reply.startswith(b"HTTP/1.1 431")
        assert rss_kib(pid) - before < 16 * 1024

    def test_too_many_headers_get_431(self, gateway):
        url, _ = gateway
        sock = connect(url)
        sock.sendall(
            HEAD + b"".join(b"X-H%d: v\r\n" % i for i in range(1000)) + b"Content-Length: 2\r\n\r\n{}"
        )
        reply = answer(sock)
        assert reply.startswith(b"HTTP/1.1 431"), reply[:200]
        assert b"RequestHeaderFieldsTooLargeError" in reply

    def test_slow_heads_idle_and_slow_bodies_are_cut_off(self, gateway):
        url, _ = gateway
        slow_heads = [connect(url) for _ in range(15)]
        idle = [connect(url) for _ in range(15)]
        slow_bodies = [connect(url) for _ in range(15)]
        for sock in slow_heads:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHo")
        for sock in slow_bodies:
            sock.sendall(HEAD + b"Content-Length: 100\r\n\r\n{")
        started = time.monotonic()
        # Each answer comes when the server gives up on the connection (its 1 s limits); that a
        # byte trickled before the deadline does not move it is tests/routing/test_client_deadlines.py's,
        # on a clock it moves.
        replies = {
            name: [answer(sock) for sock in socks]
            for name, socks in (("head", slow_heads), ("idle", idle), ("body", slow_bodies))
        }
        elapsed_s = time.monotonic() - started
        for sock in slow_heads + idle + slow_bodies:
            sock.close()
        assert all(reply.startswith(b"HTTP/1.1 408") for reply in replies["head"]), replies["head"][0]
        assert all(reply == b"" for reply in replies["idle"])  # a silent connection is just closed
        assert all(reply.startswith(b"HTTP/1.1 408") for reply in replies["body"]), replies["body"][0]
        assert elapsed_s < 8  # limits of 1 s; before: still open after 100 s

    def test_an_idle_keep_alive_connection_is_closed(self, gateway):
        url, _ = gateway
        sock = connect(url)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: gw\r\n\r\n")
        reply = answer(sock)  # returns once the server closes the kept-alive connection
        assert reply.startswith(b"HTTP/1.1 200")


class TestConnectionCap:
    def test_connections_past_the_cap_get_503(self, redis_keys, redis_url, processes):
        url = start_gateway(
            processes, redis_url, redis_keys, env={"GORGO_AUTH": "off", "GORGO_MAX_CONNECTIONS": "5"}
        )
        held = [connect(url) for _ in range(5)]
        time.sleep(0.2)
        extra = connect(url)
        reply = answer(extra)
        for sock in [*held, extra]:
            sock.close()
        assert reply.startswith(b"HTTP/1.1 503"), reply
        assert b"retry-after: 1" in reply.lower()
