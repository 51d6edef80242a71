"""Pass a node's answer to the client, or the gateway's own error: never buffer a stream.

A plain body is read whole and sent in one piece. A stream is sent chunk by chunk as it arrives,
keeping only its last few kilobytes for the usage event; silence between two chunks longer than
the idle timeout is a hung node. Once the status went out nothing is retried: a break mid-stream
is said in the stream (as vLLM says its own errors) and recorded.
"""

from __future__ import annotations

import asyncio
import time
from typing import Final

from routing.contract import NodeSpec
from routing.errors import GatewayError
from routing.http.client_side import ClientRequest
from routing.http.headers import filter_response_headers
from routing.http.upstream import ReadTimeout, UpstreamError, UpstreamResponse
from routing.http.usage import USAGE_TAIL_BYTES
from routing.http.usage_read import parse_stream_error, parse_stream_usage, parse_usage
from routing.observability.exporter import GatewayMetrics
from routing.observability.tracing import GatewayTracing
from routing.proxy.exchange import Exchange
from routing.resilience.breaker import Breakers
from routing.state.table import RoutingTable

_perf_counter: Final = time.perf_counter  # a C static, compiled: no module lookup per call
# The last event of an OpenAI stream, with either line ending SSE allows.
_SSE_DONE_ENDINGS: Final = (b"data: [DONE]\n\n", b"data: [DONE]\r\n\r\n")
# The end of an SSE event (a blank line), with each line ending SSE allows.
_SSE_EVENT_ENDINGS: Final = (b"\n\n", b"\r\r", b"\r\n\r\n")


class Relay:
    """Answers the client: the node's response, or a ``GatewayError`` in OpenAI's shape."""

    def __init__(
        self,
        idle_timeout_s: float,
        breakers: Breakers,
        metrics: GatewayMetrics,
        tracing: GatewayTracing | None,
    ) -> None:
        self._idle_timeout_s = idle_timeout_s
        self._breakers = breakers
        self._metrics = metrics
        self._tracing = tracing
        # The answer's first gateway fields per node of ``_fields_table`` (its node and policy
        # version, and the name of the request id's): the same bytes on every answer of a table.
        self._fields_table: RoutingTable | None = None
        self._fields: dict[int, bytes] = {}

    def _node_fields(self, table: RoutingTable, node: NodeSpec) -> bytes:
        if table is not self._fields_table:
            self._fields_table = table
            self._fields = {}
        fields = self._fields.get(node.id)
        if fields is None:
            fields = self._fields[node.id] = (
                b"\r\nx-gorgo-node: %s\r\nx-gorgo-policy-version: %s\r\nx-request-id: "
                % (
                    node.name.encode(),
                    table.version_header,
                )
            )
        return fields

    async def answer(
        self, client: ClientRequest, exchange: Exchange, table: RoutingTable, response: UpstreamResponse
    ) -> None:
        """Pass the node's answer to the client: streams chunk by chunk, bodies in one piece."""
        assert exchange.decision is not None and exchange.lease is not None and exchange.sent_s is not None
        node = exchange.decision.node
        upstream_s = _perf_counter() - exchange.sent_s
        exchange.status = status = response.status
        out_headers = filter_response_headers(response.raw_headers)
        # The gateway's own fields after the node's, written here as the head's bytes (the client
        # side's per-field work is for headers it has to check: ~2 k instructions an answer less).
        own = b"%s%s\r\nserver-timing: route;dur=%.3f, upstream;dur=%.3f" % (
            self._node_fields(table, node),
            exchange.request_id.encode(),
            # bytes' own %: compiled, an f-string formats each float through a method call
            exchange.routing_s * 1000,
            upstream_s * 1000,
        )
        grant = exchange.grant
        if grant is not None and grant.head:
            own += grant.head
        if response.content_type != "text/event-stream":
            try:
                data = await response.read()
            except UpstreamError as exc:
                kind = "timeout" if isinstance(exc, ReadTimeout) else "disconnect"
                self._breakers.failure(node.id, time.monotonic(), hard=kind == "timeout")
                self._metrics.upstream_error(node.name, kind)
                raise GatewayError(
                    504 if kind == "timeout" else 502,
                    f"The node {node.name} stopped before its answer was complete ({kind}).",
                    node_name=node.name,
                ) from None
            exchange.lease.first_byte()
            exchange.finished = True
            exchange.response_started = True
            exchange.ttft_s = _perf_counter() - exchange.arrival_s
            client.respond(status, out_headers, data, own)  # head and body in one write
            exchange.bytes_out = len(data)
            if status == 200 and not response.content_encoded:
                exchange.usage = parse_usage(data)
            if exchange.span is not None:
                assert self._tracing is not None
                self._tracing.answer(exchange.span, data, stream=False)
            return

        exchange.response_started = True
        client.start(status, out_headers, own)
        tail = b""
        bytes_out = 0
        # A key with a tokens/min limit: its events are counted as they pass, so a stream without
        # a usage event (or cut midway) is charged what it generated (FrontDoor.done).
        key = exchange.key
        counted = grant if grant is not None and key is not None and key.tokens_per_min else None
        loop = asyncio.get_running_loop()
        idle_s = self._idle_timeout_s
        try:
            # Until the first chunk the node may be queueing and prefilling (the socket read
            # timeout governs); after it, silence longer than the idle timeout means a hung node.
            chunk = await response.readany()
            if chunk:
                exchange.lease.first_byte()
                exchange.ttft_s = _perf_counter() - exchange.arrival_s
            async with asyncio.timeout(None) as idle:
                while chunk:
                    if counted is not None:
                        counted.stream_events += chunk.count(b"data: {")
                    await client.write(chunk)
                    bytes_out += len(chunk)
                    tail = (
                        chunk[-USAGE_TAIL_BYTES:]
                        if len(chunk) >= USAGE_TAIL_BYTES
                        else (tail + chunk)[-USAGE_TAIL_BYTES:]
                    )
                    if tail.endswith(_SSE_DONE_ENDINGS):
                        # The client has the whole answer: OpenAI clients stop at [DONE] and may
                        # hang up before the node's end of body reaches us. Not a disconnect.
                        exchange.finished = True
                    idle.reschedule(loop.time() + idle_s)
                    chunk = await response.readany()
                    idle.reschedule(None)  # the client's pace is not the node's silence
        except (UpstreamError, TimeoutError) as broke:
            # Not ``exc``: compiled (routing/native.py), a variable has one type per function, and
            # ``exc`` is an ``UpstreamError`` above, so binding a TimeoutError to it raised TypeError.
            # Mid-stream failure: the status is already sent, so say it in the stream (as vLLM
            # does for its own errors) and end it; the record keeps the truth.
            kind = "timeout" if isinstance(broke, (TimeoutError, ReadTimeout)) else "disconnect"
            if isinstance(broke, TimeoutError):  # ours: the idle timeout between two chunks
                self._metrics.timeout("idle")
            self._breakers.failure(node.id, time.monotonic(), hard=kind == "timeout")
            self._metrics.upstream_error(node.name, kind)
            exchange.status = 504 if kind == "timeout" else 502
            exchange.error = f"node {node.name} stream broke ({kind})"
            event = GatewayError(exchange.status, f"The node {node.name} stopped mid-stream ({kind}).")
            chunk = b"data: " + event.body() + b"\n\n"
            if tail and not tail.endswith(_SSE_EVENT_ENDINGS):
                # The node stopped inside an event: end it first, or the client's SSE parser
                # reads the error as more of that event's line and never sees it.
                chunk = b"\n\n" + chunk
            await client.write(chunk)
            bytes_out += len(chunk)
        exchange.bytes_out = bytes_out
        exchange.finished = True
        client.end()
        if status == 200:
            exchange.usage = parse_stream_usage(tail)
            node_error = parse_stream_error(tail) if exchange.status == 200 else None
            if node_error is not None:
                # The node failed the request after its 200 went out (vLLM's error event): the
                # client has the event as the node sent it; the record keeps what it says.
                code = node_error.code
                exchange.status = code if isinstance(code, int) and 400 <= code < 600 else 500
                exchange.error = (
                    f"node {node.name} ended the stream with an error: {node_error.message[:200]}"
                )
        if exchange.span is not None:
            assert self._tracing is not None
            self._tracing.answer(exchange.span, tail, stream=True)

    def error(self, client: ClientRequest, exchange: Exchange, error: GatewayError) -> None:
        """Answer with the gateway's own error (nothing of it reached the client yet)."""
        exchange.status = error.status
        exchange.error = exchange.error or error.message
        if error.status >= 500 and error.node_name is not None:
            exchange.error = f"{error.node_name}: {error.message}"
        body = error.body()
        headers = error.headers()
        if exchange.request_id:
            headers.append((b"x-request-id", exchange.request_id.encode()))
        if exchange.table is not None:
            headers.append((b"x-gorgo-policy-version", exchange.table.version_header))
        exchange.finished = True
        exchange.response_started = True
        client.respond(error.status, headers, body)
        exchange.bytes_out = len(body)
