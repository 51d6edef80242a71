"""HTTP/1.1 correctness of the gateway process, over raw sockets on 127.0.0.1 (issue 15).

What any server stack under the gateway must keep: Content-Length and chunked bodies both ways,
keep-alive and pipelining, ``Expect: 100-continue``, head limits, the request-smuggling defences
(Content-Length with Transfer-Encoding, duplicate Content-Length: 400), half-closed connections,
and a client that hangs up cancelling its upstream request.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import sys
import time

import httptools
import httpx
import pytest
import redis

from routing.writer import write
from simulator.harness import wait_until
from tests.routing.support import MODEL, make_node, make_snapshot
from tests.routing.test_e2e_gateway import start_gateway

pytestmark = pytest.mark.e2e

PATH = b"/v1/chat/completions"


def start_fleet(processes, redis_url, redis_keys, env: dict[str, str]):
    """(gateway address, upstream URL): one node process behind one gateway process."""
    process = processes.start(
        "upstream", [sys.executable, "-m", "tests.routing.http_upstream"], ready_text="READY"
    )
    port = re.search(r"READY (\d+)", process.log()).group(1)
    upstream = f"http://127.0.0.1:{port}"
    client = redis.Redis.from_url(redis_url)
    write(client, redis_keys, make_snapshot((make_node(1, upstream),)))
    client.close()
    url = start_gateway(processes, redis_url, redis_keys, env=env)
    host, port = url.removeprefix("http://").split(":")
    return (host, int(port)), upstream


@pytest.fixture
def fleet(redis_keys, redis_url, processes):
    """(gateway address, upstream URL): one node process behind one gateway process."""
    return start_fleet(processes, redis_url, redis_keys, {"GORGO_CLIENT_MAX_HEADERS": "50"})


def body(stub: dict | None = None, stream: bool = False, pad: int = 0) -> bytes:
    message = {"role": "user", "content": "hello " + "x" * pad}
    data = {"model": MODEL, "messages": [message], "stream": stream, "stub": stub or {}}
    return json.dumps(data).encode()


def request(payload: bytes, *headers: bytes, framing: bytes | None = None) -> bytes:
    """A POST head (+ payload with a Content-Length unless ``framing`` replaces that line)."""
    lines = [b"POST " + PATH + b" HTTP/1.1", b"Host: gw", b"Content-Type: application/json", *headers]
    lines.append(framing if framing is not None else b"Content-Length: %d" % len(payload))
    return b"\r\n".join(lines) + b"\r\n\r\n" + (payload if framing is None else b"")


def chunked(payload: bytes, size: int = 1000) -> bytes:
    parts = [
        b"%x\r\n%s\r\n" % (len(payload[i : i + size]), payload[i : i + size])
        for i in range(0, len(payload), size)
    ]
    return b"".join(parts) + b"0\r\n\r\n"


class Response:
    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.raw_headers: list[tuple[str, str]] = []
        self.body = b""
        self.complete = False
        self.chunks: list[bytes] = []

    def json(self) -> dict:
        return json.loads(self.body)


class Reader:
    """Parses the responses on one connection, pipelined or not (httptools, as a client would)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.done: list[Response] = []
        self._current: Response | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.closed = False

    def on_message_begin(self) -> None:
        self._current = Response()

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self._current is not None
        self._current.headers[name.decode().lower()] = value.decode()
        self._current.raw_headers.append((name.decode().lower(), value.decode()))

    def on_headers_complete(self) -> None:
        assert self._current is not None
        self._current.status = self._parser.get_status_code()

    def on_body(self, data: bytes) -> None:
        assert self._current is not None
        self._current.body += data
        self._current.chunks.append(data)

    def on_message_complete(self) -> None:
        assert self._current is not None
        self._current.complete = True
        self.done.append(self._current)
        self._current = None

    def read(self, count: int = 1, timeout_s: float = 10.0) -> list[Response]:
        self.sock.settimeout(timeout_s)
        while len(self.done) < count:
            data = self.sock.recv(65536)
            if not data:
                self.closed = True
                break
            self._parser.feed_data(data)
        got, self.done = self.done[:count], self.done[count:]
        return got

    def raw(self, timeout_s: float = 5.0) -> bytes:
        """Everything until the server closes (for answers that must close the connection)."""
        self.sock.settimeout(timeout_s)
        data = b""
        try:
            while chunk := self.sock.recv(65536):
                data += chunk
        except (ConnectionResetError, TimeoutError):
            pass
        return data


def connect(address: tuple[str, int]) -> tuple[socket.socket, Reader]:
    sock = socket.create_connection(address, timeout=10)
    return sock, Reader(sock)


def upstream_seen(upstream: str) -> dict:
    return httpx.get(f"{upstream}/_seen", timeout=5).json()


class TestBodies:
    def test_a_content_length_body_arrives_whole_and_the_answer_has_a_content_length(self, fleet):
        address, upstream = fleet
        payload = body(pad=100_000)
        sock, reader = connect(address)
        sock.sendall(request(payload))
        (answer,) = reader.read()
        assert answer.status == 200, answer.body
        assert answer.json()["received_sha256"] == hashlib.sha256(payload).hexdigest()
        assert int(answer.headers["content-length"]) == len(answer.body)
        (seen,) = upstream_seen(upstream)["seen"]
        assert seen["bytes"] == len(payload)
        sock.close()

    def test_a_chunked_request_body_is_forwarded_whole(self, fleet):
        address, upstream = fleet
        payload = body(pad=50_000)
        sock, reader = connect(address)
        sock.sendall(request(payload, framing=b"Transfer-Encoding: chunked") + chunked(payload))
        (answer,) = reader.read()
        assert answer.status == 200, answer.body
        assert answer.json()["received_sha256"] == hashlib.sha256(payload).hexdigest()
        (seen,) = upstream_seen(upstream)["seen"]
        names = {name.lower() for name, _ in seen["headers"]}
        assert "transfer-encoding" not in names or "content-length" not in names
        sock.close()

    def test_a_chunked_upstream_answer_reaches_the_client_whole(self, fleet):
        address, _ = fleet
        payload = body({"chunked": True})
        sock, reader = connect(address)
        sock.sendall(request(payload))
        (answer,) = reader.read()
        assert answer.status == 200
        assert answer.json()["received_sha256"] == hashlib.sha256(payload).hexdigest()
        sock.close()

    def test_a_stream_is_sent_chunked_and_ends_with_the_last_chunk(self, fleet):
        address, _ = fleet
        sock, reader = connect(address)
        sock.sendall(request(body({"events": 4}, stream=True)))
        (answer,) = reader.read()
        assert answer.status == 200
        assert answer.headers["transfer-encoding"] == "chunked"
        assert "content-length" not in answer.headers
        events = [line for line in answer.body.split(b"\n\n") if line]
        assert events[-1] == b"data: [DONE]" and len(events) == 5
        sock.close()


class TestConnections:
    def test_keep_alive_serves_several_requests_on_one_connection(self, fleet):
        address, _ = fleet
        sock, reader = connect(address)
        for index in range(3):
            payload = body(pad=index)
            sock.sendall(request(payload))
            (answer,) = reader.read()
            assert answer.status == 200
            assert answer.json()["received_bytes"] == len(payload)
        sock.close()

    def test_pipelined_requests_are_answered_in_order(self, fleet):
        address, _ = fleet
        payloads = [body(pad=10 * index, stream=index == 1) for index in range(3)]
        sock, reader = connect(address)
        sock.sendall(b"".join(request(payload) for payload in payloads))
        answers = reader.read(3)
        assert [answer.status for answer in answers] == [200, 200, 200]
        assert answers[0].json()["received_bytes"] == len(payloads[0])
        assert answers[1].body.endswith(b"data: [DONE]\n\n")
        assert answers[2].json()["received_bytes"] == len(payloads[2])
        sock.close()

    def test_expect_100_continue_gets_an_interim_answer_before_the_body(self, fleet):
        address, upstream = fleet
        payload = body()
        sock, reader = connect(address)
        head = request(payload, b"Expect: 100-continue")
        sock.sendall(head[: len(head) - len(payload)])
        sock.settimeout(5)
        interim = sock.recv(65536)
        assert interim.startswith(b"HTTP/1.1 100"), interim
        sock.sendall(payload)
        (answer,) = reader.read()
        assert answer.status == 200
        (seen,) = upstream_seen(upstream)["seen"]
        assert "expect" not in {name.lower() for name, _ in seen["headers"]}
        sock.close()

    def test_head_gets_get_s_head_without_its_body_and_the_connection_stays_usable(self, fleet):
        address, _ = fleet
        sock, reader = connect(address)
        sock.settimeout(10)
        sock.sendall(b"HEAD /healthz HTTP/1.1\r\nHost: gw\r\n\r\n")
        head = b""
        while b"\r\n\r\n" not in head:
            head += sock.recv(65536)
        assert head.startswith(b"HTTP/1.1 200") and head.endswith(b"\r\n\r\n")  # nothing after
        assert int(re.search(rb"content-length: (\d+)", head.lower()).group(1)) > 0
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: gw\r\n\r\n")
        (answer,) = reader.read()  # the next bytes are the next answer, not a stray body
        assert answer.status == 200 and answer.json()["status"] == "ok"
        sock.close()

    def test_an_http_1_0_client_gets_its_stream_unchunked_until_the_connection_closes(self, fleet):
        """RFC 9112 6.1: no Transfer-Encoding in an answer to an HTTP/1.0 request, which cannot
        decode it. Before, an HTTP/1.0 client's stream came chunked: its SSE events were mixed with
        chunk sizes, and with ``Connection: keep-alive`` it waited for an end of file that came
        only with the keep-alive timeout."""
        address, _ = fleet
        for keep_alive in ((), (b"Connection: keep-alive",)):
            sock, reader = connect(address)
            head = request(body({"events": 3}, stream=True), *keep_alive)
            sock.sendall(head.replace(b" HTTP/1.1\r\n", b" HTTP/1.0\r\n", 1))
            reply = reader.raw(timeout_s=5)  # all of it: the end of file ends the body
            sock.close()
            head, _, payload = reply.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), reply[:200]
            assert b"transfer-encoding" not in head.lower() and b"connection: close" in head.lower()
            events = [event for event in payload.split(b"\n\n") if event]
            assert events[0].startswith(b"data: {") and events[-1] == b"data: [DONE]", payload[:200]

    def test_a_half_closed_connection_counts_as_a_client_gone(self, fleet):
        """TCP cannot tell shutdown(SHUT_WR) from close(): a FIN mid-request cancels the upstream.

        (hyper's default, and nginx's: GPU work for a client that may be gone is the costlier
        mistake.) The gateway closes its side too, so nothing is left half-open.
        """
        address, upstream = fleet
        sock, reader = connect(address)
        sock.sendall(request(body({"events": 200, "chunk_delay_s": 0.05}, stream=True)))
        sock.settimeout(10)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        sock.shutdown(socket.SHUT_WR)
        reader.raw(timeout_s=10)  # returns once the gateway closed its side
        wait_until(lambda: upstream_seen(upstream)["aborted"] == 1, 5.0, what="upstream aborted")
        sock.close()

    def test_a_half_closed_idle_connection_is_closed(self, fleet):
        address, _ = fleet
        sock, reader = connect(address)
        sock.sendall(request(body()))
        (answer,) = reader.read()
        assert answer.status == 200
        sock.shutdown(socket.SHUT_WR)
        started = time.monotonic()
        assert reader.raw(timeout_s=5) == b""
        assert time.monotonic() - started < 4
        sock.close()

    def test_a_client_that_hangs_up_cancels_the_upstream_request(self, fleet):
        address, upstream = fleet
        sock, _ = connect(address)
        sock.sendall(request(body({"events": 200, "chunk_delay_s": 0.05}, stream=True)))
        sock.settimeout(10)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        sock.close()
        wait_until(lambda: upstream_seen(upstream)["aborted"] == 1, 5.0, what="upstream aborted")


class TestLimitsAndSmuggling:
    def _refused(self, address: tuple[str, int], data: bytes) -> bytes:
        sock, reader = connect(address)
        sock.sendall(data)
        reply = reader.raw()
        sock.close()
        return reply

    def test_content_length_with_transfer_encoding_is_refused(self, fleet):
        address, upstream = fleet
        payload = body()
        data = request(
            payload, b"Content-Length: %d" % len(payload), framing=b"Transfer-Encoding: chunked"
        ) + chunked(payload)
        reply = self._refused(address, data)
        assert reply.startswith(b"HTTP/1.1 400"), reply[:100]
        assert upstream_seen(upstream)["seen"] == []

    def test_duplicate_content_length_is_refused(self, fleet):
        address, upstream = fleet
        payload = body()
        for second in (len(payload), len(payload) - 1):
            data = request(payload, b"Content-Length: %d" % second)
            reply = self._refused(address, data)
            assert reply.startswith(b"HTTP/1.1 400"), reply[:100]
        assert upstream_seen(upstream)["seen"] == []

    def test_an_unknown_transfer_coding_is_refused(self, fleet):
        address, upstream = fleet
        payload = body()
        reply = self._refused(
            address, request(payload, framing=b"Transfer-Encoding: gzip, chunked") + chunked(payload)
        )
        assert reply.startswith(b"HTTP/1.1 501"), reply[:100]
        assert upstream_seen(upstream)["seen"] == []

    def test_trailer_fields_are_not_merged_into_the_head(self, fleet):
        """RFC 9110 6.5.1: a trailer field is not a header field. Before, a chunked body's trailer
        fields were appended to the request's headers and forwarded to the node as such."""
        address, upstream = fleet
        payload = body()
        data = request(payload, framing=b"Transfer-Encoding: chunked") + chunked(payload)
        data = data.removesuffix(b"\r\n") + b"X-Smuggled: trailer\r\n\r\n"
        sock, reader = connect(address)
        sock.sendall(data)
        (answer,) = reader.read()
        assert answer.status == 200, answer.body
        sock.close()
        (seen,) = upstream_seen(upstream)["seen"]
        assert "x-smuggled" not in {name.lower() for name, _ in seen["headers"]}

    def test_a_head_past_the_limit_gets_431_even_when_it_arrives_in_one_read(self, fleet):
        """Before, the head limit was checked only on a head still incomplete after a read: a 70 kB
        head (limit 64 KiB) that completed within a read was accepted and forwarded to the node."""
        address, upstream = fleet
        reply = self._refused(address, request(body(), b"X-Big: " + b"a" * 70_000))
        assert openai_error(reply, 431)["type"] == "RequestHeaderFieldsTooLargeError"
        assert upstream_seen(upstream)["seen"] == []

    def test_too_many_header_fields_get_431(self, fleet):
        address, _ = fleet
        extra = [b"X-H%d: v" % index for index in range(60)]
        reply = self._refused(address, request(body(), *extra))
        assert reply.startswith(b"HTTP/1.1 431"), reply[:100]

    def test_a_malformed_request_gets_400_and_the_connection_closes(self, fleet):
        """What follows a framing error is not trusted: the connection ends with the 400."""
        address, upstream = fleet
        data = b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: x\r\n\r\n" + request(body())
        reply = self._refused(address, data)
        assert reply.startswith(b"HTTP/1.1 400")
        assert reply.count(b"HTTP/1.1") == 1
        assert upstream_seen(upstream)["seen"] == []


@pytest.fixture
def tight_fleet(redis_keys, redis_url, processes):
    """Like ``fleet``, with a 10 kB body limit and a 1 s send timeout."""
    env = {"GORGO_MAX_BODY_BYTES": "10000", "GORGO_CLIENT_SEND_TIMEOUT_S": "1"}
    return start_fleet(processes, redis_url, redis_keys, env)


def openai_error(reply: bytes, status: int) -> dict:
    """The one answer on a connection the server closed: OpenAI's JSON error shape, not text."""
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d" % status), reply[:200]
    assert b"content-type: application/json" in head.lower(), head
    assert b"connection: close" in head.lower(), head
    error = json.loads(payload)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


class TestFramingErrorsAndStuckClients:
    """Issue 22, item 7: framing errors got uvicorn's ``400 text/plain``, an over-limit chunked
    body's 413 left the connection open for the body timeout (30 s), and a client that never read
    its stream held it (and the node's generation) forever."""

    def _refused(self, address: tuple[str, int], data: bytes) -> bytes:
        sock, reader = connect(address)
        sock.sendall(data)
        reply = reader.raw()
        sock.close()
        return reply

    def test_framing_errors_get_openai_shaped_json(self, fleet):
        address, upstream = fleet
        payload = body()
        cases = {
            "CL + TE": request(
                payload, b"Content-Length: %d" % len(payload), framing=b"Transfer-Encoding: chunked"
            )
            + chunked(payload),
            "bad chunk size": request(payload, framing=b"Transfer-Encoding: chunked")
            + b"zz\r\n{}\r\n0\r\n\r\n",
            "NUL in a header": request(payload, b"X-Evil: a\x00b"),
            "HTTP/2 preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        }
        for name, data in cases.items():
            error = openai_error(self._refused(address, data), 400)
            assert error["type"] == "BadRequestError", name
            assert error["message"].startswith("Invalid HTTP request"), (name, error)
        assert upstream_seen(upstream)["seen"] == []

    def test_a_bad_second_request_on_a_kept_alive_connection_is_answered_too(self, fleet):
        address, _ = fleet
        sock, reader = connect(address)
        sock.sendall(request(body()))
        assert reader.read(1)[0].status == 200
        sock.sendall(b"GET / HTTP/1.1\r\nX-Evil: a\x00b\r\n\r\n")
        reply = reader.raw()
        sock.close()
        openai_error(reply, 400)

    def test_an_over_limit_chunked_body_gets_413_and_the_connection_ends(self, tight_fleet):
        address, upstream = tight_fleet
        sock, reader = connect(address)
        # 20 kB of a chunked body, never finished (no last chunk): the repro kept it open 30 s.
        sock.sendall(request(b"", framing=b"Transfer-Encoding: chunked") + b"400\r\n" + b"x" * 1024 + b"\r\n")
        for _ in range(19):
            sock.sendall(b"400\r\n" + b"x" * 1024 + b"\r\n")
        (answer,) = reader.read(1)
        assert answer.status == 413 and answer.json()["error"]["type"] == "RequestEntityTooLargeError"
        assert answer.headers.get("connection") == "close"
        sock.settimeout(10)  # far below the 30 s body timeout that used to end it
        try:
            assert sock.recv(65536) == b""  # end of file: the gateway is done with it
        except ConnectionResetError:
            pass  # closed as well
        sock.close()
        assert upstream_seen(upstream)["seen"] == []

    def test_a_client_that_never_reads_its_stream_is_cut_and_the_node_request_cancelled(self, tight_fleet):
        address, upstream = tight_fleet
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills at once
        sock.connect(address)
        # ~10 MB of events, sent as fast as the node can: far more than every buffer between.
        sock.sendall(request(body({"events": 120_000}, stream=True)))
        sock.recv(64)  # the head has come: the client now stops reading
        wait_until(lambda: upstream_seen(upstream)["aborted"] >= 1, timeout_s=20)
        sock.close()
