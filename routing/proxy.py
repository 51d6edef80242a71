"""The request path of ``/v1/chat/completions`` and ``/v1/completions``.

Read the body (size-capped), decode the routing fields, look the model up in the current routing
table, let the policy's algorithm choose among the eligible nodes, forward the client's body bytes
unchanged over the pooled keep-alive client, and pass the answer back: a stream chunk by chunk as
it arrives, a plain body in one piece. Then count it and queue its request record.

Failure rules: a node that refuses the connection (or drops it before answering) is retried once on
another eligible node, and only then does the client get a 502; nothing is retried once a byte went
to the client. A client that disconnects cancels the upstream request (the node sees the
connection close and aborts the generation).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time

from routing.algorithms.base import Decision, RoutingRequest, RoutingView
from routing.cache.prompt import (
    DEFAULT_CHARS_PER_TOKEN,
    BodyError,
    Endpoint,
    ParsedRequest,
    PrefixIndex,
    parse_body,
)
from routing.cache.token_ratio import CharsPerToken
from routing.cache.tokenization import PromptIds, Tokenizers
from routing.config import GatewayConfig
from routing.contract import SCHEMA_VERSION, ClientKeySpec, NodeSpec, RequestRecord
from routing.deadlines import FixedDelay
from routing.errors import GatewayError
from routing.frontdoor.admission import Admission
from routing.frontdoor.front_door import FrontDoor, Grant
from routing.http.asgi import (
    ClientGone,
    DisconnectWatch,
    Receive,
    Scope,
    Send,
    filter_response_headers,
    read_body,
    scan_request_headers,
    send_response,
)
from routing.http.upstream import (
    ConnectFailed,
    ConnectTimeout,
    Disconnected,
    ProtocolError,
    ReadTimeout,
    UpstreamClient,
    UpstreamError,
    UpstreamResponse,
    encode_headers,
)
from routing.http.usage import USAGE_TAIL_BYTES, PromptTokensDetails, Usage, parse_stream_usage, parse_usage
from routing.observability.exporter import NO_NODE, GatewayMetrics
from routing.observability.request_log import RequestLog
from routing.observability.tracing import GatewayTracing
from routing.resilience.breaker import Breakers, RetryBudget
from routing.resilience.node_probe import HungWatch, NodeProber
from routing.state.inflight import InFlight, Lease
from routing.state.policy_store import PolicyStore
from routing.state.table import RoutingTable

logger = logging.getLogger("routing.proxy")

# The last event of an OpenAI stream, with either line ending SSE allows.
_SSE_DONE_ENDINGS = (b"data: [DONE]\n\n", b"data: [DONE]\r\n\r\n")


class _Exchange:
    """Everything one request accumulates on its way through, for the record and the metrics."""

    __slots__ = (
        "arrival_s",
        "bytes_out",
        "client_gone",
        "decision",
        "error",
        "finished",
        "grant",
        "key",
        "lease",
        "parsed",
        "prediction",
        "prompt_tokens_est",
        "request_id",
        "response_started",
        "routing_s",
        "sent_s",
        "span",
        "status",
        "stream",
        "table",
        "ts",
        "ttft_s",
        "usage",
    )

    def __init__(self, arrival_s: float, ts: float, table: RoutingTable | None) -> None:
        self.arrival_s = arrival_s
        self.ts = ts
        self.table = table
        self.request_id = ""
        self.parsed: ParsedRequest | None = None
        self.prompt_tokens_est = 0
        self.prediction: tuple[int, str, int] | None = None  # node, index mode, predicted cached tokens
        self.decision: Decision | None = None
        self.lease: Lease | None = None
        self.routing_s = 0.0
        self.sent_s: float | None = None
        self.ttft_s: float | None = None
        self.status = 0
        self.stream = False
        self.bytes_out = 0
        self.error: str | None = None
        self.usage: Usage | None = None
        self.finished = False  # the last byte is on its way: a disconnect now is not the client leaving
        self.client_gone = False
        self.response_started = False
        self.key: ClientKeySpec | None = None
        self.grant: Grant | None = None  # what the front door granted the key
        self.span = None  # the OpenTelemetry span, only while tracing is on


class Proxy:
    """Routes and forwards the OpenAI inference endpoints."""

    def __init__(
        self,
        config: GatewayConfig,
        client: UpstreamClient,
        store: PolicyStore,
        inflight: InFlight,
        request_log: RequestLog,
        metrics: GatewayMetrics,
        prefix_index: PrefixIndex,
        chars_per_token: CharsPerToken | None = None,
        front_door: FrontDoor | None = None,
        breakers: Breakers | None = None,
        admission: Admission | None = None,
        prober: NodeProber | None = None,
        tracing: GatewayTracing | None = None,
        tokenizers: Tokenizers | None = None,
    ) -> None:
        self._config = config
        self._client = client
        self._store = store
        self._inflight = inflight
        self._request_log = request_log
        self._metrics = metrics
        self._prefix_index = prefix_index
        self._tokenizers = tokenizers
        self._chars_per_token = chars_per_token or CharsPerToken(DEFAULT_CHARS_PER_TOKEN)
        self._region = config.region
        self._region_header = (b"X-Gorgo-Region", config.region.encode())
        self._gateway_id = config.gateway_id
        self._max_body_bytes = config.max_body_bytes
        self._sequence = 0
        self._id_prefix = f"gw-{os.urandom(4).hex()}-"
        self._ids = itertools.count(1)
        self._front_door = front_door
        self._breakers = breakers if breakers is not None else Breakers(open_s=config.node_down_cooldown_s)
        self._retry_budget = RetryBudget(config.retry_budget_ratio)
        self._admission = admission
        self._prober = prober
        self._loop: asyncio.AbstractEventLoop | None = None
        self._hung_timers = FixedDelay(config.upstream_first_byte_timeout_s)
        self._tracing = tracing

    async def handle(self, scope: Scope, receive: Receive, send: Send, endpoint: Endpoint) -> None:
        exchange = _Exchange(time.perf_counter(), time.time(), self._store.table)
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        # With the loop given, no getpid() syscall (Python 3.11 checks the pid on every lookup
        # of the running loop: 2% of the gateway's CPU in the profile).
        task = asyncio.current_task(loop)
        watch: DisconnectWatch | None = None
        try:
            try:
                table = exchange.table
                session_header = table.session_header if table is not None else None
                front_door = self._front_door
                scanned = scan_request_headers(
                    scope["headers"], session_header, keep_credentials=front_door is None
                )
                headers = scanned.forward
                exchange.request_id = scanned.request_id or f"{self._id_prefix}{next(self._ids):x}"
                headers.append((b"X-Request-Id", exchange.request_id.encode()))
                headers.append(self._region_header)
                if front_door is not None:  # before the body: a stranger's body is not worth reading
                    exchange.key = front_door.authenticate(scanned)
                body = await read_body(receive, scanned.content_length, self._max_body_bytes)
                if self._tracing is not None:
                    exchange.span = self._tracing.start(
                        scope["headers"], headers, endpoint, body, exchange.ts
                    )
                if table is None:
                    raise GatewayError(503, "The gateway has no routing policy loaded yet.", retry_after_s=1)
                try:
                    parsed = parse_body(endpoint, body)
                except BodyError as exc:
                    raise GatewayError(400, str(exc), param=exc.param) from None
                exchange.parsed = parsed
                exchange.stream = parsed.stream
                exchange.prompt_tokens_est = parsed.prompt_tokens_est(self._chars_per_token.value)
                if exchange.key is not None:
                    assert front_door is not None
                    exchange.grant = await front_door.admit(
                        exchange.key, parsed.model, exchange.prompt_tokens_est
                    )
                session_key = scanned.session_key
                # From here on the request waits on a node: watch for the client leaving.
                assert task is not None
                watch = DisconnectWatch(receive, exchange, task)
                await self._forward(send, exchange, table, parsed, endpoint, headers, body, session_key)
            except GatewayError as exc:
                await self._send_error(send, exchange, exc)
        except asyncio.CancelledError:
            if not exchange.client_gone:
                raise
            assert task is not None
            task.uncancel()  # the cancellation was ours (client left), not the server's
            exchange.status = 499
            exchange.error = "client disconnected"
        except ClientGone:
            exchange.status = 499
            exchange.error = "client disconnected"
        except Exception:
            logger.exception("request %s failed inside the gateway", exchange.request_id)
            exchange.error = "internal gateway error"
            if not exchange.response_started:
                await self._send_error(
                    send,
                    exchange,
                    GatewayError(500, f"Internal gateway error (request id {exchange.request_id})."),
                )
            else:
                exchange.status = exchange.status or 500
        finally:
            if watch is not None:
                watch.stop()
            if exchange.lease is not None:
                exchange.lease.release()
            if exchange.key is not None and self._front_door is not None:
                self._front_door.done(exchange.key, exchange.grant, exchange.usage, exchange.status)
            self._finish(exchange)

    # ---- routing -----------------------------------------------------------------------------

    def _route(
        self,
        table: RoutingTable,
        candidates: tuple[NodeSpec, ...],
        request: RoutingRequest,
        prompt_text: str,
        prompt_ids: PromptIds | None = None,
    ) -> Decision:
        algorithm = table.algorithm
        # The index is only fed and asked while the policy uses it: a least_load gateway pays
        # nothing for it (after a switch to a cache-aware policy it warms up from live traffic
        # and from the other gateways' shared insertions).
        uses_index = algorithm.needs_prefix_matches
        node_ids = tuple(node.id for node in candidates)
        if not uses_index:
            matched: dict[int, int] = {}
        elif prompt_ids is not None and prompt_ids.complete:
            matched = self._prefix_index.match(node_ids, prompt_text, prompt_ids.ids)
        else:
            matched = self._prefix_index.match(node_ids, prompt_text)
        self._sequence += 1
        view = RoutingView(
            table.region,
            candidates,
            table.snapshot.policy.params,
            self._inflight.load_view(),
            table.rtt_ms,
            table.live,
            matched,
            self._sequence,
            self._gateway_id,
        )
        decision = algorithm.choose(view, request)
        if uses_index:
            self._prefix_index.insert(decision.node.id, prompt_text)
        return decision

    def _wants_prompt_ids(self, candidates: tuple[NodeSpec, ...]) -> bool:
        """Whether any candidate is matched precisely (tokenizing costs ~0.2 ms: only then)."""
        wants = getattr(self._prefix_index, "wants_prompt_ids", None)
        return wants is not None and wants(candidates)

    def _candidates(self, table: RoutingTable, model: str) -> tuple[NodeSpec, ...]:
        candidates = table.candidates.get(model)
        if candidates is None:
            raise GatewayError(404, f"The model `{model}` does not exist on this gateway.", param="model")
        blocked = self._breakers.blocked
        if blocked:
            working = tuple(node for node in candidates if node.id not in blocked)
            if not working:
                # Every eligible node failed here recently: say so rather than hammer them (stale
                # or late telemetry must not send traffic to a node this gateway saw fail).
                raise GatewayError(
                    503,
                    f"Every eligible node for model `{model}` is failing ({len(candidates)} with an "
                    "open circuit breaker); retry shortly.",
                    retry_after_s=max(1.0, self._breakers.next_probe_in_s(time.monotonic())),
                )
            candidates = working
        if not candidates:
            excluded = table.excluded.get(model, {})
            reasons = ", ".join(f"{count} {reason}" for reason, count in sorted(excluded.items()))
            raise GatewayError(
                503,
                f"No eligible node for model `{model}` from region {table.region}"
                + (f" ({reasons})." if reasons else "."),
                retry_after_s=5,
            )
        return candidates

    # ---- forwarding --------------------------------------------------------------------------

    async def _forward(
        self,
        send: Send,
        exchange: _Exchange,
        table: RoutingTable,
        parsed: ParsedRequest,
        endpoint: Endpoint,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        session_key: str | None,
    ) -> None:
        candidates = self._candidates(table, parsed.model)
        admission = self._admission
        if admission is not None:
            with_room = admission.with_room(candidates)
            if not with_room:
                priority = exchange.key.priority if exchange.key is not None else "interactive"
                node = await admission.wait(candidates, priority)
                admission.claim(node.id)  # from here to the lease in _open: no await
                with_room = (node,)
            candidates = with_room
        routing_start_s = time.perf_counter()
        # The prompt's token ids, when the model has a tokenizer and the policy uses the index
        # (precise matching on KV events); their count is exact, unlike the estimate.
        prompt_ids = (
            self._tokenizers.prompt_ids(parsed.model, endpoint, body)
            if self._tokenizers is not None
            and table.algorithm.needs_prefix_matches
            and self._wants_prompt_ids(candidates)
            else None
        )
        if prompt_ids is not None and prompt_ids.complete:
            exchange.prompt_tokens_est = len(prompt_ids.ids)
        prompt_tokens_est = exchange.prompt_tokens_est
        request = RoutingRequest(
            parsed.model, parsed.prompt_chars, prompt_tokens_est, session_key or parsed.user
        )
        self._retry_budget.deposit()
        decision = self._route(table, candidates, request, parsed.prompt_text, prompt_ids)
        exchange.routing_s = time.perf_counter() - routing_start_s
        self._metrics.observe_decision(exchange.routing_s)
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"

        response = await self._open(
            exchange,
            table,
            candidates,
            decision,
            request,
            parsed,
            path,
            encode_headers(headers),
            body,
            prompt_ids,
        )
        try:
            await self._relay(send, exchange, table, response)
        finally:
            response.close()  # a no-op once released; drops the connection if we stopped midway

    async def _open(
        self,
        exchange: _Exchange,
        table: RoutingTable,
        candidates: tuple[NodeSpec, ...],
        decision: Decision,
        request: RoutingRequest,
        parsed: ParsedRequest,
        path: str,
        headers: bytes,
        body: bytes,
        prompt_ids: PromptIds | None = None,
    ) -> UpstreamResponse:
        """Send the request to the chosen node; before any byte came back, retry on another.

        Retried: a refused connection, a connection dropped before the answer, and (streams) no
        response headers within the first-byte timeout (vLLM sends a stream's headers at once, so
        silence means a hung node). At most ``upstream_retries`` times, within the retry budget.
        """
        tried: list[NodeSpec] = []
        config = self._config
        first_byte_s = config.upstream_first_byte_timeout_s if parsed.stream else None
        breakers = self._breakers
        task = asyncio.current_task(self._loop)
        fresh = False
        while True:
            node = decision.node
            exchange.decision = decision
            exchange.prediction = getattr(self._prefix_index, "last_prediction", None)
            exchange.lease = self._inflight.begin(node.id, _prefill_tokens(decision, request))
            exchange.sent_s = time.perf_counter()
            hung_watch = (
                HungWatch(
                    self._prober,
                    task,
                    node.id,
                    table.base_urls[node.id],
                    self._hung_timers,
                )
                if first_byte_s is None and self._prober is not None and task is not None
                else None
            )
            target = table.urls.get((node.id, path))
            try:
                if target is None:
                    raise ConnectFailed(f"node {node.name} has no usable http(s) URL")
                if first_byte_s is None:
                    response = await self._client.request(target, headers, body, fresh=fresh)
                else:
                    async with asyncio.timeout(first_byte_s):
                        response = await self._client.request(target, headers, body, fresh=fresh)
            except asyncio.CancelledError:
                if hung_watch is None or not hung_watch.hung or exchange.client_gone:
                    raise
                assert task is not None
                task.uncancel()  # ours: the node answers nothing, not even /health
                kind, hard = "first_byte", True
                self._metrics.timeout("first_byte")
            except ConnectTimeout:
                kind, hard = "connect", True
                self._metrics.timeout("connect")
            except ConnectFailed:
                kind, hard = "connect", True
            except ReadTimeout:
                breakers.failure(node.id, time.monotonic(), hard=True)
                self._metrics.upstream_error(node.name, "timeout")
                raise GatewayError(
                    504, f"Node {node.name} did not answer in time.", node_name=node.name
                ) from None
            except TimeoutError:  # ours: no response headers within the first-byte timeout
                kind, hard = "first_byte", True
                self._metrics.timeout("first_byte")
            except Disconnected:
                kind, hard = "disconnect", False
            except ProtocolError as exc:
                breakers.failure(node.id, time.monotonic(), hard=False)
                self._metrics.upstream_error(node.name, "protocol")
                logger.warning("node %s sent an unreadable response: %s", node.name, exc)
                raise GatewayError(
                    502, f"Node {node.name} sent an invalid response.", node_name=node.name
                ) from None
            else:
                if response.status >= 500:
                    breakers.failure(node.id, time.monotonic(), hard=False)
                else:
                    breakers.success(node.id)
                return response
            finally:
                if hung_watch is not None:
                    hung_watch.stop()
            breakers.failure(node.id, time.monotonic(), hard=hard)
            exchange.lease.release()
            exchange.lease = None
            self._metrics.upstream_error(node.name, "timeout" if kind == "first_byte" else kind)
            tried.append(node)
            blocked = breakers.blocked
            remaining = tuple(c for c in candidates if c not in tried and c.id not in blocked)
            # A keep-alive connection the node closed just as we reused it says nothing about the
            # node: the only candidate gets one more try on a fresh connection.
            same_node_again = kind == "disconnect" and not remaining and len(tried) == 1
            if (
                len(tried) > config.upstream_retries
                or not (remaining or same_node_again)
                or not self._retry_budget.spend()
            ):
                status = 504 if kind == "first_byte" else 502
                what = (
                    f"did not start answering within {first_byte_s:g}s"
                    if kind == "first_byte"
                    else "is unreachable"
                )
                raise GatewayError(
                    status,
                    f"Node {node.name} {what}" + (" (and so was the retry)." if len(tried) > 1 else "."),
                    node_name=node.name,
                )
            self._metrics.retry(kind)
            logger.warning("node %s failed before answering (%s); retrying", node.name, kind)
            if remaining:
                decision = self._route(table, remaining, request, parsed.prompt_text, prompt_ids)
            else:
                # A keep-alive connection the node closed just as we reused it says nothing about
                # the node; the only candidate gets one more try on a fresh connection.
                fresh = True

    async def _relay(
        self, send: Send, exchange: _Exchange, table: RoutingTable, response: UpstreamResponse
    ) -> None:
        """Pass the node's answer to the client: streams chunk by chunk, bodies in one piece."""
        assert exchange.decision is not None and exchange.lease is not None and exchange.sent_s is not None
        node = exchange.decision.node
        upstream_s = time.perf_counter() - exchange.sent_s
        exchange.status = status = response.status
        out_headers = filter_response_headers(response.raw_headers)
        out_headers += (
            (b"x-gorgo-node", node.name.encode()),
            (b"x-gorgo-policy-version", table.version_header),
            (b"x-request-id", exchange.request_id.encode()),
            (
                b"server-timing",
                f"route;dur={exchange.routing_s * 1000:.3f}, upstream;dur={upstream_s * 1000:.3f}".encode(),
            ),
        )
        if exchange.grant is not None and exchange.grant.headers:
            out_headers += exchange.grant.headers
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
            await send({"type": "http.response.start", "status": status, "headers": out_headers})
            exchange.ttft_s = time.perf_counter() - exchange.arrival_s
            await send({"type": "http.response.body", "body": data, "more_body": False})
            exchange.bytes_out = len(data)
            if status == 200 and not response.content_encoded:
                exchange.usage = parse_usage(data)
            if exchange.span is not None:
                self._tracing.answer(exchange.span, data, stream=False)
            return

        exchange.response_started = True
        await send({"type": "http.response.start", "status": status, "headers": out_headers})
        tail = b""
        bytes_out = 0
        loop = asyncio.get_running_loop()
        idle_s = self._config.upstream_idle_timeout_s
        try:
            # Until the first chunk the node may be queueing and prefilling (the socket read
            # timeout governs); after it, silence longer than the idle timeout means a hung node.
            chunk = await response.readany()
            if chunk:
                exchange.lease.first_byte()
                exchange.ttft_s = time.perf_counter() - exchange.arrival_s
            async with asyncio.timeout(None) as idle:
                while chunk:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
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
        except (UpstreamError, TimeoutError) as exc:
            # Mid-stream failure: the status is already sent, so say it in the stream (as vLLM
            # does for its own errors) and end it; the record keeps the truth.
            kind = "timeout" if isinstance(exc, (TimeoutError, ReadTimeout)) else "disconnect"
            if isinstance(exc, TimeoutError):  # ours: the idle timeout between two chunks
                self._metrics.timeout("idle")
            self._breakers.failure(node.id, time.monotonic(), hard=kind == "timeout")
            self._metrics.upstream_error(node.name, kind)
            exchange.status = 504 if kind == "timeout" else 502
            exchange.error = f"node {node.name} stream broke ({kind})"
            event = GatewayError(exchange.status, f"The node {node.name} stopped mid-stream ({kind}).")
            chunk = b"data: " + event.body() + b"\n\n"
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            bytes_out += len(chunk)
        exchange.bytes_out = bytes_out
        exchange.finished = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        if status == 200:
            exchange.usage = parse_stream_usage(tail)
        if exchange.span is not None:
            self._tracing.answer(exchange.span, tail, stream=True)

    async def _send_error(self, send: Send, exchange: _Exchange, error: GatewayError) -> None:
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
        await send_response(send, error.status, body, headers)
        exchange.bytes_out = len(body)

    # ---- bookkeeping -------------------------------------------------------------------------

    def _observe_cache(
        self,
        node_id: int,
        matched_tokens: int,
        exchange: _Exchange,
        usage: Usage,
        details: PromptTokensDetails,
    ) -> None:
        """Tell the prefix index how much the node really had cached versus what it predicted."""
        if not (exchange.prompt_tokens_est and usage.prompt_tokens and details.cached_tokens is not None):
            return
        self._prefix_index.observe(
            node_id,
            matched_tokens / exchange.prompt_tokens_est,
            details.cached_tokens / usage.prompt_tokens,
            time.time(),
        )

    def _finish(self, exchange: _Exchange) -> None:
        """Count the request and queue its record; never raises into the request."""
        try:
            total_s = time.perf_counter() - exchange.arrival_s
            decision = exchange.decision
            node = decision.node if decision is not None else None
            self._metrics.observe_request(
                node.name if node is not None else NO_NODE, exchange.status, exchange.ttft_s, total_s
            )
            table = exchange.table
            parsed = exchange.parsed
            usage = exchange.usage
            details = usage.prompt_tokens_details if usage is not None else None
            if details is not None and decision is not None and decision.cost is not None:
                self._observe_cache(
                    decision.cost.node_id, decision.cost.matched_tokens, exchange, usage, details
                )
            prediction = exchange.prediction
            if (
                prediction is not None
                and details is not None
                and details.cached_tokens is not None
                and node is not None
                and prediction[0] == node.id
            ):
                record = getattr(self._prefix_index, "record_outcome", None)
                if record is not None:
                    record(node.id, prediction[1], prediction[2], details.cached_tokens)
            if (
                usage is not None
                and usage.prompt_tokens
                and parsed is not None
                and parsed.prompt_tokens_exact is None
                and self._chars_per_token.observe(parsed.prompt_chars, usage.prompt_tokens)
            ):
                # The index counts its chunks in tokens: it follows the estimate's ratio.
                self._prefix_index.set_chars_per_token(self._chars_per_token.value)
            record = RequestRecord(
                schema_version=SCHEMA_VERSION,
                request_id=exchange.request_id,
                ts=exchange.ts,
                gateway_region=self._region,
                gateway_id=self._config.gateway_id,
                model=parsed.model if parsed is not None else "",
                status=exchange.status,
                stream=exchange.stream,
                node_id=node.id if node is not None else None,
                node_region=node.region if node is not None else None,
                algorithm=table.snapshot.policy.algorithm if table is not None else None,
                policy_version=table.snapshot.version if table is not None else None,
                prompt_chars=parsed.prompt_chars if parsed is not None else 0,
                prompt_tokens_est=exchange.prompt_tokens_est,
                prompt_tokens=usage.prompt_tokens if usage is not None else None,
                cached_tokens=details.cached_tokens if details is not None else None,
                completion_tokens=usage.completion_tokens if usage is not None else None,
                routing_us=exchange.routing_s * 1e6,
                gateway_ms=(exchange.sent_s - exchange.arrival_s) * 1000 if exchange.sent_s else 0.0,
                ttft_ms=exchange.ttft_s * 1000 if exchange.ttft_s is not None else None,
                total_ms=total_s * 1000,
                bytes_out=exchange.bytes_out,
                error=exchange.error,
                cost=decision.cost if decision is not None else None,
                runner_up=decision.runner_up if decision is not None else None,
                key_id=exchange.key.id if exchange.key is not None else None,
                priority=exchange.key.priority if exchange.key is not None else None,
                prefix_index_mode=prediction[1] if prediction is not None else None,
                predicted_cached_tokens=prediction[2] if prediction is not None else None,
            )
            self._request_log.submit(record)
            if exchange.span is not None:
                self._tracing.finish(exchange.span, record, node)
        except Exception:
            logger.exception("could not record request %s", exchange.request_id)


def _prefill_tokens(decision: Decision, request: RoutingRequest) -> int:
    """Prefill the node has to do: what the algorithm found uncached, else the whole prompt."""
    cost = decision.cost
    if cost is not None and cost.node_id == decision.node.id:
        return cost.uncached_tokens
    return request.prompt_tokens_est
