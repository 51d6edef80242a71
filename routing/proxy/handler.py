"""The request path of ``/v1/chat/completions`` and ``/v1/completions``.

Read the body (size-capped), decode the routing fields, look the model up in the current routing
table, let the policy's algorithm choose among the eligible nodes, forward the client's body bytes
unchanged over the pooled keep-alive client, and pass the answer back: a stream chunk by chunk as
it arrives, a plain body in one piece. Then count it and queue its request record.

The pieces are the proxy's neighbours: the front door (``routing.frontdoor``) says who may call,
the retry loop (``routing.resilience.retry``) gets a response from some node, ``relay`` passes it
on, and ``outcome`` records what happened. This module ties them in order.

Failure rules: a node that refuses the connection (or drops it before answering) is retried once on
another eligible node, and only then does the client get a 502; nothing is retried once a byte went
to the client. A client that disconnects cancels the upstream request (the node sees the
connection close and aborts the generation).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Final

from routing.algorithms import least_load
from routing.algorithms.base import AlgorithmInfo, Decision, PrefixRent, RoutingRequest, RoutingView
from routing.cache.approx_index import CHUNK_BYTES
from routing.cache.parsed import ParsedRequest
from routing.cache.prompt import (
    DEFAULT_CHARS_PER_TOKEN,
    BodyError,
    Endpoint,
    PrefixIndex,
    parse_body,
)
from routing.cache.token_ratio import CharsPerToken
from routing.cache.tokenization import PromptIds, Tokenizers
from routing.config import GatewayConfig
from routing.contract import NodeSpec
from routing.errors import GatewayError
from routing.frontdoor.admission import Admission
from routing.frontdoor.auth import AuthError
from routing.frontdoor.front_door import FrontDoor
from routing.http.client_side import ClientRequest
from routing.http.headers import ClientGone, scan_request_headers
from routing.http.upstream import UpstreamClient, encode_headers
from routing.observability.exporter import GatewayMetrics
from routing.observability.request_log import RequestLog
from routing.observability.tracing import GatewayTracing
from routing.proxy.exchange import Exchange
from routing.proxy.outcome import RequestOutcome
from routing.proxy.relay import Relay
from routing.proxy.shadow import decide_with_shadow
from routing.resilience.breaker import Breakers
from routing.resilience.node_probe import NodeProber
from routing.resilience.retry import Retrier
from routing.state.homing import HomingLedger
from routing.state.inflight import InFlight
from routing.state.measured import MeasuredInputs
from routing.state.policy_store import PolicyStore
from routing.state.table import RoutingTable
from routing.state.trials import TrialRoute, in_canary

logger = logging.getLogger("routing.proxy")

# The most characters one token can stand for in practice: a prompt with more than
# ``max_context_tokens`` times this many characters is past the model's context whatever its
# tokenizer (ordinary text runs 3-5 characters a token), and is refused without a node round trip.
MAX_CHARS_PER_TOKEN: Final = 16
_HEX_PAIRS: Final = tuple(f"{value:02x}" for value in range(256))
# The clocks as C statics (compiled: ``time.perf_counter()`` looks the name up in the module each
# call, ~250 instructions).
_perf_counter: Final = time.perf_counter
_time: Final = time.time
_PROMPT_PARAMS: Final[dict[str, str]] = {"chat": "messages", "completions": "prompt", "embeddings": "input"}


def _check_context(table: RoutingTable, parsed: ParsedRequest, endpoint: Endpoint) -> None:
    """vLLM's 400 for a prompt past the model's context (issue 22, item 5), when even the most
    generous count of tokens says so. Before, a 3.9 MB prompt went to the node (which refused it)
    after the gateway had rendered, indexed and perhaps tokenized all of it."""
    limit = table.max_context_tokens.get(parsed.model)
    if not limit:
        return
    exact = parsed.prompt_tokens_exact
    at_least = exact if exact is not None else parsed.prompt_chars // MAX_CHARS_PER_TOKEN
    if at_least <= limit:
        return
    counted = "" if exact is not None else f" (counted from its {parsed.prompt_chars} characters)"
    raise GatewayError(
        400,
        f"This model's maximum context length is {limit} tokens. However, your request has at "
        f"least {at_least} input tokens{counted}. Please reduce the length of the input.",
        param=_PROMPT_PARAMS.get(endpoint),
    )


def _client_left(exchange: Exchange, task: asyncio.Task[None]) -> None:
    """The client hung up: cancel its request (the node sees its connection close and stops),
    unless the last byte was already on its way (OpenAI clients may hang up at ``[DONE]``)."""
    if not exchange.finished:
        exchange.client_gone = True
        task.cancel()


# Waits in the admission queue for one request: one, and again only when the node it was granted
# stopped being eligible meanwhile (a drain, a new policy, an open breaker).
_MAX_ADMISSION_WAITS: Final = 3
_PATHS: Final[dict[str, str]] = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
}


# The proxied endpoints by path (the gateway answers the rest itself: routing/app.py).
ENDPOINTS: Final[dict[str, Endpoint]] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
}


class Dispatch:
    """What the client side calls per request: a POST to an inference endpoint goes straight to
    the proxy's (compiled) coroutine, anything else to ``other`` (the gateway's own answers).

    Compiled, and so called without a Python frame: ``Gateway.handle`` did this in
    ``routing/app.py``'s Python, ~2.5 k instructions a request. ``proxy`` is set while the gateway
    runs (None before its start and from its shutdown on: ``other`` answers then).
    """

    def __init__(self, other: Callable[[ClientRequest], Awaitable[None]]) -> None:
        self.proxy: Proxy | None = None
        self._other = other

    def __call__(self, request: ClientRequest) -> Awaitable[None]:
        proxy = self.proxy
        if proxy is not None and request.method == "POST":
            endpoint = ENDPOINTS.get(request.path)
            if endpoint is not None:
                return proxy.handle(request, endpoint)
        return self._other(request)


class _Reroute:
    """A retry's choice among the nodes left: the proxy's routing with the request's own inputs
    (the live policy or its canary, the index; no shadow, which judged the first choice only).

    Not a lambda: compiled, a lambda holds the coroutine's environment, which holds the retry
    loop's (a temporary across the await), which holds the lambda: a cycle per request left for
    the garbage collector (tests/routing/test_request_garbage.py). Nor a ``partial`` with keyword
    arguments: that built a dict per request (~2 k instructions), used only on a retry.
    """

    __slots__ = ("_endpoint", "_prompt_ids", "_prompt_text", "_proxy", "_request", "_route", "_table")

    def __init__(
        self,
        proxy: Proxy,
        table: RoutingTable,
        request: RoutingRequest,
        prompt_text: str,
        prompt_ids: PromptIds | None,
        route: TrialRoute | None,
        endpoint: Endpoint,
    ) -> None:
        self._proxy = proxy
        self._table = table
        self._request = request
        self._prompt_text = prompt_text
        self._prompt_ids = prompt_ids
        self._route = route
        self._endpoint = endpoint

    def __call__(self, candidates: tuple[NodeSpec, ...]) -> Decision:
        return self._proxy._route(
            self._table,
            candidates,
            self._request,
            self._prompt_text,
            self._prompt_ids,
            self._route,
            None,
            self._endpoint,
        )


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
        cache_index: PrefixIndex,
        chars_per_token: CharsPerToken | None = None,
        front_door: FrontDoor | None = None,
        breakers: Breakers | None = None,
        admission: Admission | None = None,
        prober: NodeProber | None = None,
        tracing: GatewayTracing | None = None,
        tokenizers: Tokenizers | None = None,
        measured: MeasuredInputs | None = None,
    ) -> None:
        self._store = store
        self._inflight = inflight
        self._metrics = metrics
        self._cache_index = cache_index  # the KV-aware index in the gateway; any PrefixIndex in tests
        # The index's optional hooks, looked up once (a getattr per request costs ~0.4 k instructions).
        self._wants_prompt_ids_of: Callable[[tuple[NodeSpec, ...]], bool] | None = getattr(
            cache_index, "wants_prompt_ids", None
        )
        self._tokenizers = tokenizers
        self._chars_per_token = chars_per_token or CharsPerToken(DEFAULT_CHARS_PER_TOKEN)
        self._region_header = (b"X-Gorgo-Region", config.region.encode())
        self._gateway_id = config.gateway_id
        self._max_body_bytes = config.max_body_bytes
        self._sequence = 0
        # What this gateway's region paid for prefixes cached only abroad (gorgo's homing); its
        # rent fades as time passes (``fade_to`` before each decision that reads it)
        self._homing = HomingLedger()
        self._tick_at_s = 0.0  # when the ledger's rent fades and stale measurements are dropped next
        # What this gateway measured of each node from its answers (gorgo's measured_inputs):
        # fed by the outcome after each streamed answer, read by the view
        self._measured = measured if measured is not None else MeasuredInputs()
        # The candidates' node ids for the prefix index, for the last candidate tuple seen
        self._ids_of: tuple[tuple[NodeSpec, ...], tuple[int, ...]] = ((), ())
        # ... and with a shadow's own candidates: (the live tuple, the shadow's, their ids together)
        self._union_of: tuple[tuple[NodeSpec, ...], tuple[NodeSpec, ...], tuple[int, ...]] = ((), (), ())
        self._id_prefix = f"gw-{os.urandom(4).hex()}-"
        self._last_id = 0  # the last request id made here (hex after the prefix)
        self._id_high = 0  # ... its digits but the last two, and the prefix with them
        self._id_high_prefix = self._id_prefix
        self._front_door = front_door
        self._breakers = breakers if breakers is not None else Breakers(open_s=config.node_down_cooldown_s)
        self._admission = admission
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tracing = tracing
        self._retrier = Retrier(config, client, inflight, metrics, cache_index, self._breakers, prober)
        self._relay = Relay(config.upstream_idle_timeout_s, self._breakers, metrics, tracing)
        self._outcome = RequestOutcome(
            config, request_log, metrics, cache_index, self._chars_per_token, tracing, self._measured
        )

    async def handle(self, client: ClientRequest, endpoint: Endpoint) -> None:
        exchange = Exchange(_perf_counter(), _time(), self._store.table)
        task = client.task  # the client side's task running this handler
        if task is None:
            loop = self._loop
            if loop is None:
                loop = self._loop = asyncio.get_running_loop()
            # With the loop given, no getpid() syscall (Python 3.11 checks the pid on every lookup
            # of the running loop: 2% of the gateway's CPU in the profile).
            task = asyncio.current_task(loop)
        try:
            try:
                table = exchange.table
                session_header = table.session_header if table is not None else None
                front_door = self._front_door
                scanned = scan_request_headers(
                    client.headers, session_header, keep_credentials=front_door is None
                )
                headers = scanned.forward
                exchange.request_id = scanned.request_id or self._new_request_id()
                headers.append((b"X-Request-Id", exchange.request_id.encode()))
                headers.append(self._region_header)
                if front_door is not None:  # before the body: a stranger's body is not worth reading
                    exchange.key = front_door.authenticate(scanned)
                body = await client.body(scanned.content_length, self._max_body_bytes)
                if self._tracing is not None:
                    exchange.span = self._tracing.start(client.headers, headers, endpoint, body, exchange.ts)
                if table is None:
                    raise GatewayError(503, "The gateway has no routing policy loaded yet.", retry_after_s=1)
                try:
                    parsed = parse_body(endpoint, body)
                except BodyError as bad_body:
                    # Not ``exc``: compiled, a variable has one type per function, and ``exc`` is a
                    # GatewayError below (binding one to a BodyError-typed name raised TypeError).
                    raise GatewayError(400, str(bad_body), param=bad_body.param) from None
                exchange.parsed = parsed
                exchange.stream = parsed.stream
                exchange.prompt_tokens_est = parsed.prompt_tokens_est(self._chars_per_token.value)
                _check_context(table, parsed, endpoint)
                if exchange.key is not None:
                    assert front_door is not None
                    exchange.grant = await front_door.admit(
                        exchange.key, parsed.model, exchange.prompt_tokens_est
                    )
                session_key = scanned.session_key
                # From here on the request waits on a node: a client that leaves cancels it.
                assert task is not None
                client.on_disconnect = lambda: _client_left(exchange, task)
                if client.disconnected:  # it left while the front door decided
                    raise ClientGone
                await self._forward(
                    client, exchange, table, parsed, endpoint, headers, body, session_key, task
                )
            except GatewayError as exc:
                if isinstance(exc, AuthError) and exc.key is not None and exchange.key is None:
                    exchange.refused_key = exc.key  # the record names the revoked/expired key
                self._relay.error(client, exchange, exc)
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
                self._relay.error(
                    client,
                    exchange,
                    GatewayError(500, f"Internal gateway error (request id {exchange.request_id})."),
                )
            else:
                exchange.status = exchange.status or 500
        finally:
            client.on_disconnect = None
            if exchange.lease is not None:
                exchange.lease.release()
            if exchange.key is not None and self._front_door is not None:
                self._front_door.done(
                    exchange.key, exchange.grant, exchange.usage, exchange.status, exchange.sent_s is not None
                )
            self._outcome.finish(exchange)

    def _new_request_id(self) -> str:
        """The prefix and a counter in hex. Formatting an int as hex costs ~1.5 k instructions
        (an f-string with a format spec more, compiled: it goes through str.format), so only its
        high digits are, once every 256 requests; the last two come from a table."""
        count = self._last_id = self._last_id + 1
        high = count >> 8
        if not high:
            return self._id_prefix + format(count, "x")
        if high != self._id_high:
            self._id_high = high
            self._id_high_prefix = self._id_prefix + format(high, "x")
        return self._id_high_prefix + _HEX_PAIRS[count & 255]

    # ---- routing -----------------------------------------------------------------------------

    def _route(
        self,
        table: RoutingTable,
        candidates: tuple[NodeSpec, ...],
        request: RoutingRequest,
        prompt_text: str,
        prompt_ids: PromptIds | None = None,
        route: TrialRoute | None = None,
        exchange: Exchange | None = None,
        endpoint: Endpoint = "chat",
    ) -> Decision:
        """Choose with the live policy (or ``route``, the canary); with ``exchange`` (the first
        choice, not a retry's) also let a running shadow decide on the same view."""
        if endpoint == "embeddings":
            # Embeddings go by load whatever the policy says: a pooling request keeps no KV cache
            # worth returning to, so prefix credit would only pile them on one node. Neither a
            # canary nor a shadow has anything to say about them.
            algorithm: AlgorithmInfo = least_load.INFO
            route, exchange, uses_index = None, None, False
        else:
            algorithm = table.algorithm if route is None else route.algorithm
            # The index is only fed and asked while a policy in the snapshot uses it: a least_load
            # gateway pays nothing for it (after a switch to a cache-aware policy it warms up from
            # live traffic and from the other gateways' shared insertions).
            uses_index = table.uses_prefix_index
        matched: dict[int, int] = {}
        if uses_index:
            if candidates is not self._ids_of[0]:  # the same tuple request after request, per model
                self._ids_of = (candidates, tuple(node.id for node in candidates))
            node_ids = self._ids_of[1]
            shadow = table.shadow if exchange is not None else None
            if shadow is not None and (route is not None or not shadow.same_guards):
                # The shadow decides on its own candidates here (other guards, or a canary's
                # request): match its nodes too, or it would price every node of its own as a miss.
                own = shadow.candidates.get(request.model)
                if own:
                    union = self._union_of
                    if candidates is not union[0] or own is not union[1]:
                        ids = dict.fromkeys(node_ids)
                        ids.update(dict.fromkeys(node.id for node in own))
                        union = self._union_of = (candidates, own, tuple(ids))
                    node_ids = union[2]
            if prompt_ids is not None and prompt_ids.complete:
                matched = (
                    # The KV-aware index (the gateway's) also takes the tenant; PrefixIndex has no such
                    # parameter, so only a tenant's prompt passes it.
                    self._cache_index.match(  # type: ignore[call-arg]
                        node_ids, prompt_text, prompt_ids.ids, prompt_ids.tenant
                    )
                    if prompt_ids.tenant is not None
                    else self._cache_index.match(node_ids, prompt_text, prompt_ids.ids)
                )
            else:
                matched = self._cache_index.match(node_ids, prompt_text)
        self._sequence += 1
        homing = uses_index and table.homes_prefixes
        measured = self._measured
        measures = table.measures_inputs if route is None else route.measures_inputs
        if homing or measures:
            now_s = _perf_counter()
            if now_s >= self._tick_at_s:  # what fades or goes stale is looked at once a second
                self._tick_at_s = now_s + 1.0
                self._homing.fade_to(now_s)
                measured.expire(now_s)
        hashes = self._cache_index.text_hashes(prompt_text) if homing else None
        view = RoutingView(
            table.region,
            candidates,
            table.params if route is None else route.params,
            self._inflight.load_view(),
            # the round trips this gateway measured in place of the probed ones (routing.state.measured)
            measured.rtt_view(table.rtt_ms) if measures else table.rtt_ms,
            table.live,
            matched,
            self._sequence,
            self._gateway_id,
            # gorgo's homing: the prompt's chunk hashes (matched above, kept for the record) and
            # what this region has paid for prefixes cached only abroad
            PrefixRent(hashes, CHUNK_BYTES / self._chars_per_token.value, self._homing.owed)
            if hashes is not None
            else None,
            measured.speed_view(candidates) if measures else None,
        )
        if exchange is not None and table.shadow is not None:
            decision, exchange.shadow = decide_with_shadow(
                algorithm, table.shadow, view, request, live_view=route is None
            )
        else:
            decision = algorithm.choose(view, request)
        if decision.rent_keys:
            if decision.homed:
                self._homing.settle(decision.rent_keys)
                self._metrics.prefix_homed()
            else:
                self._homing.pay(decision.rent_keys, decision.rent_ms)
                self._metrics.prefix_rent(decision.rent_ms)
        if uses_index:
            self._cache_index.insert(decision.node.id, prompt_text)
            if exchange is not None:
                # Hashed once for match and insert: the request's record keeps the same hashes.
                exchange.prefix_hashes = (
                    hashes if hashes is not None else self._cache_index.text_hashes(prompt_text)
                )
            # Read now, on this request's decision: the index's attribute is the last decision
            # of any request, and a policy that never asks the index must record no prediction.
            prediction = getattr(self._cache_index, "last_prediction", None)
            if prediction is not None:
                # Not dataclasses.replace: that costs microseconds a request (issue 23's budget).
                decision = Decision(
                    decision.node,
                    decision.cost,
                    decision.runner_up,
                    prediction,
                    decision.rent_keys,
                    decision.rent_ms,
                    decision.homed,
                )
        return decision

    def _canary_route(
        self, table: RoutingTable, exchange: Exchange, model: str, session_key: str | None
    ) -> TrialRoute | None:
        """The canary when it runs and this request's session is in its share (None: the live policy).

        Sessions are keyed by the session key, else the client key, else (nothing ties the
        request to others) the request id. A canary that serves no node for the model leaves
        the request to the live policy.
        """
        canary = table.canary
        if canary is None:
            return None
        exchange.canary_id = canary.id
        key = session_key or (exchange.key.id if exchange.key is not None else None) or exchange.request_id
        if in_canary(canary, key) and canary.candidates.get(model):
            exchange.arm = "canary"
            return canary
        exchange.arm = "live"
        return None

    def _wants_prompt_ids(self, candidates: tuple[NodeSpec, ...]) -> bool:
        """Whether any candidate is matched precisely (tokenizing costs ~0.2 ms: only then)."""
        wants = self._wants_prompt_ids_of
        return wants is not None and wants(candidates)

    def _candidates(
        self, table: RoutingTable, model: str, route: TrialRoute | None = None
    ) -> tuple[NodeSpec, ...]:
        # Read apart: the table's is a dict (a dict read, compiled), a trial's a Mapping.
        candidates = table.candidates.get(model) if route is None else route.candidates.get(model)
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
        client: ClientRequest,
        exchange: Exchange,
        table: RoutingTable,
        parsed: ParsedRequest,
        endpoint: Endpoint,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        session_key: str | None,
        task: asyncio.Task[None],
    ) -> None:
        # ``task`` is the request's own, as ``handle`` found it (Python 3.11's ``current_task`` is a
        # Python function: not looked up twice). A canary serves the sessions its hash picks: they
        # are routed by its policy throughout (its candidates, its algorithm, its retries).
        # Embeddings go by load on either side, so they stay out of the canary's comparison.
        route = (
            self._canary_route(table, exchange, parsed.model, session_key or parsed.user)
            if endpoint != "embeddings"
            else None
        )
        candidates = self._candidates(table, parsed.model, route)
        admission = self._admission
        if admission is not None:
            with_room = admission.with_room(candidates)
            waits = 0
            while not with_room:
                if waits == _MAX_ADMISSION_WAITS:
                    raise GatewayError(
                        503,
                        f"The eligible nodes for model `{parsed.model}` kept changing while this "
                        "request waited for room; retry shortly.",
                        retry_after_s=1,
                    )
                waits += 1
                priority = exchange.key.priority if exchange.key is not None else "interactive"
                node = await admission.wait(candidates, priority)
                admission.claim(node.id)  # from here to the retry loop's lease: no await
                # The wait may have lasted seconds: the node may have been drained or removed (a new
                # policy snapshot) or have failed here (its breaker) meanwhile. Route on the table
                # and breakers as they are now; a node no longer eligible passes its slot on.
                current = self._store.table
                if current is not None and current is not table:
                    table = exchange.table = current
                    if endpoint != "embeddings":
                        exchange.canary_id = exchange.arm = None
                        route = self._canary_route(table, exchange, parsed.model, session_key or parsed.user)
                candidates = self._candidates(table, parsed.model, route)
                with_room = tuple(each for each in candidates if each.id == node.id)
                if not with_room:
                    admission.released(node.id)
                    with_room = admission.with_room(candidates)
            candidates = with_room
        routing_start_s = _perf_counter()
        # The prompt's token ids, when the model has a tokenizer and the policy uses the index
        # (precise matching on KV events); their count is exact, unlike the estimate.
        prompt_ids = (
            self._tokenizers.prompt_ids(parsed.model, endpoint, body)
            if self._tokenizers is not None
            and endpoint != "embeddings"
            and table.uses_prefix_index
            and self._wants_prompt_ids(candidates)
            else None
        )
        if prompt_ids is not None and prompt_ids.complete:
            exchange.prompt_tokens_est = len(prompt_ids.ids)
        prompt_tokens_est = exchange.prompt_tokens_est
        request = RoutingRequest(
            parsed.model, parsed.prompt_chars, prompt_tokens_est, session_key or parsed.user
        )
        self._retrier.budget.deposit()
        decision = self._route(
            table, candidates, request, parsed.prompt_text, prompt_ids, route, exchange, endpoint
        )
        exchange.routing_s = _perf_counter() - routing_start_s
        self._metrics.observe_decision(exchange.routing_s)
        path = _PATHS[endpoint]

        response = await self._retrier.open(
            exchange,
            table,
            candidates,
            decision,
            request,
            parsed.stream,
            path,
            encode_headers(headers),
            body,
            _Reroute(self, table, request, parsed.prompt_text, prompt_ids, route, endpoint),
            task,
        )
        grant = exchange.grant
        if grant is not None and response.status == 200:
            grant.served = True  # the node took it on: a cut answer keeps its charge (FrontDoor.done)
        head_s = exchange.head_s
        if parsed.stream and response.status == 200 and head_s is not None and exchange.sent_s:
            # The round trip is known now, long before the answer ends (routing.state.measured).
            served = exchange.decision.node if exchange.decision is not None else None
            if served is not None:
                self._measured.observe_head(served, head_s, (head_s - exchange.sent_s) * 1000)
        try:
            await self._relay.answer(client, exchange, table, response)
        finally:
            response.close()  # a no-op once released; drops the connection if we stopped midway
