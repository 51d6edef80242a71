"""The gateway application: ``Gateway.handle`` answers one request of the client side.

No framework and no ASGI: the client side (``routing/http/client_side.py``, served by
``routing/http/server.py``) calls ``handle`` with each parsed request, chosen by measurement like
the upstream client (``routing/http/upstream.py``; benchmarks/gateway_overhead.py,
docs/gateway.md): a framework's routing, request and response objects, and even uvicorn's ASGI
cycle, cost more per request than this gateway's whole routing decision.

Per-process resources (the upstream connection pools, the Redis client, the policy store, the request
log, metrics) are opened by ``startup`` and closed by ``shutdown`` (the server's lifespan) and live
on ``Gateway.runtime``; nothing is a module-level singleton, so tests can run several gateways in
one process.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import msgspec
from redis.asyncio import Redis

from routing.algorithms import REGISTRY
from routing.algorithms.base import AlgorithmInfo
from routing.background import Flag, run_bounded
from routing.cache.approx_index import ApproxPrefixIndex
from routing.cache.kv_aware_index import KVAwareIndex
from routing.cache.kv_events.collector import KVEventsCollector
from routing.cache.kv_events.manager import KVEvents
from routing.cache.kv_events.report import report_kv_state
from routing.cache.kv_events.subscriber import EventSource
from routing.cache.model_folder import tokenizer_files
from routing.cache.prompt import DEFAULT_CHARS_PER_TOKEN, PrefixIndex
from routing.cache.token_ratio import CharsPerToken
from routing.cache.tokenization import Tokenizers
from routing.config import GatewayConfig
from routing.contract import RedisKeys
from routing.errors import JSON_CONTENT_TYPE, GatewayError
from routing.frontdoor.admission import Admission
from routing.frontdoor.concurrency import ConcurrencyLimiter
from routing.frontdoor.front_door import FrontDoor
from routing.frontdoor.keystore import KeyStore
from routing.frontdoor.ratelimit import RateLimiter, make_limiter_redis
from routing.http.client_side import ClientRequest, ClientStats
from routing.http.headers import scan_request_headers
from routing.http.upstream import UpstreamClient
from routing.observability.exporter import CONTENT_TYPE, GatewayMetrics, StateCollector
from routing.observability.request_log import RequestLog
from routing.observability.tracing import GatewayTracing, tracing_from_env
from routing.proxy.handler import ENDPOINTS, Dispatch, Proxy
from routing.resilience.breaker import Breakers
from routing.resilience.node_probe import NodeProber
from routing.state.inflight import InFlight
from routing.state.measured import MeasuredInputs
from routing.state.policy_store import PolicyStore, make_redis
from routing.state.sharing import GatewaySharing
from routing.state.table import RoutingTable

logger = logging.getLogger("routing.app")

_GC_GEN0_THRESHOLD = 10_000
# A 405's Allow field (RFC 9110 15.5.6: the methods the resource takes).
_ALLOW_POST = (b"allow", b"POST")
_ALLOW_GET = (b"allow", b"GET, HEAD")
_SUPPORTED = "/v1/chat/completions, /v1/completions, /v1/embeddings, /v1/models"
# vLLM's other endpoints, and why the gateway does not route them (501, so a client can tell "not
# here" from a typo'd path).
_NOT_ROUTED: dict[str, str] = {
    "/v1/responses": "it keeps conversation state on the node that answered (previous_response_id)",
    "/tokenize": "token ids depend on the node's tokenizer; it serves no generation",
    "/detokenize": "token ids depend on the node's tokenizer; it serves no generation",
    "/v1/audio/": "no node of the fleet serves audio models",
    "/v1/score": "the fleet serves generative models, not scoring ones",
    "/v1/rerank": "the fleet serves generative models, not reranking ones",
    "/rerank": "the fleet serves generative models, not reranking ones",
    "/score": "the fleet serves generative models, not scoring ones",
    "/pooling": "the fleet serves generative models, not pooling ones",
    "/classify": "the fleet serves generative models, not classification ones",
    "/v1/images/": "no node of the fleet serves image generation",
    "/v1/files": "the gateway keeps no files",
    "/v1/batches": "the gateway runs no batch jobs",
    "/v1/load_lora_adapter": "nodes are managed by the control plane",
    "/v1/unload_lora_adapter": "nodes are managed by the control plane",
}


def _not_routed(path: str) -> GatewayError | None:
    """501 naming the endpoint, why it is not routed and what is (``None`` for unknown paths)."""
    reason = _NOT_ROUTED.get(path)
    if reason is None:
        reason = next(
            (why for prefix, why in _NOT_ROUTED.items() if prefix.endswith("/") and path.startswith(prefix)),
            None,
        )
    if reason is None:
        return None
    return GatewayError(
        501,
        f"{path} is not supported by this gateway: {reason}. It routes {_SUPPORTED}.",
        code="unsupported_endpoint",
    )


@dataclass(slots=True)
class Runtime:
    """What one gateway process holds open while it runs."""

    redis: Redis
    client: UpstreamClient
    store: PolicyStore
    request_log: RequestLog
    sharing: GatewaySharing
    inflight: InFlight
    metrics: GatewayMetrics
    proxy: Proxy
    front_door: FrontDoor | None
    limiter_redis: Redis | None
    prober: NodeProber
    tracing: GatewayTracing | None = None


class Gateway:
    """The gateway application. ``runtime`` exists between ``startup`` and ``shutdown``."""

    def __init__(
        self,
        config: GatewayConfig,
        *,
        registry: Mapping[str, AlgorithmInfo] = REGISTRY,
        prefix_index: ApproxPrefixIndex | None = None,
        tracing: GatewayTracing | None = None,
    ) -> None:
        self.config = config
        self.registry = registry
        self.prefix_index = prefix_index if prefix_index is not None else ApproxPrefixIndex()
        # Nodes that publish KV events are matched on them, the others on the approximate index.
        self.kv_events = KVEvents()
        self.tokenizers = Tokenizers()
        self.index = KVAwareIndex(self.prefix_index, self.kv_events)
        self._background: set[asyncio.Task[None]] = set()
        self._kv_report_stop = Flag()
        self._kv_report: asyncio.Task[None] | None = None
        # Learned from the nodes' usage reports; the policy's chars_per_token is its prior.
        self.chars_per_token = CharsPerToken(DEFAULT_CHARS_PER_TOKEN)
        # Outstanding work per node (this gateway's, plus its peers' once sharing runs); told where
        # the nodes are at each snapshot, so it can count a node's own region's requests.
        self.inflight = InFlight(config.region)
        self.tracing = tracing  # None: from the OTEL_* environment (off unless an endpoint is set)
        self.runtime: Runtime | None = None
        # What the client side calls per request (compiled: a proxied request's awaitable is the
        # proxy's own coroutine, no Python frame in between); the rest goes to ``_handle``.
        self.handle = Dispatch(self._handle)
        self.client_stats = ClientStats()  # the client side's connections and refusals, for /metrics

    # ---- lifespan ----------------------------------------------------------------------------

    async def startup(self) -> None:
        """Open the per-process clients and load the policy (the gateway starts even without Redis)."""
        config = self.config
        keys = RedisKeys(prefix=config.redis_prefix)
        redis = make_redis(config.redis_url)
        # No pool cap: the nodes' own max_num_seqs is the real limit. Bytes pass through as the
        # node encoded them (nothing is decompressed).
        client = UpstreamClient(
            connect_timeout_s=config.upstream_connect_timeout_s,
            read_timeout_s=config.upstream_read_timeout_s,
            keepalive_s=config.upstream_keepalive_s,
        )
        index = self.index
        ratio = self.chars_per_token
        store = PolicyStore(
            redis,
            keys,
            config.region,
            self.registry,
            live_refresh_interval_s=config.live_refresh_interval_s,
            live_stale_s=config.live_stale_s,
            on_snapshot=lambda table: self._on_snapshot(table),
        )
        request_log = RequestLog(
            redis,
            keys,
            maxlen=config.request_log_maxlen,
            pending_max=config.request_log_pending_max,
            flush_interval_s=config.request_log_flush_interval_s,
        )
        inflight = self.inflight
        sharing = GatewaySharing(
            redis,
            keys,
            gateway_id=config.gateway_id,
            region=config.region,
            index=self.prefix_index,
            load_source=lambda: (
                inflight.outstanding_requests(),
                inflight.outstanding_prefill_tokens(),
                inflight.home_requests(),
                inflight.outstanding_context_tokens(),
            ),
            on_peer_load=inflight.set_peer_load,
        )
        metrics = GatewayMetrics()
        measured = MeasuredInputs()
        breakers = Breakers(
            failure_threshold=config.breaker_failures,
            open_s=config.node_down_cooldown_s,
            max_open_s=config.breaker_max_open_s,
        )
        admission = Admission(
            inflight,
            factor=config.admission_factor,
            max_length=config.queue_max_length,
            max_wait_s=config.queue_max_wait_s,
            on_wait=metrics.queue_wait,
            on_reject=metrics.queue_rejected,
        )
        inflight.on_release = admission.released
        front_door: FrontDoor | None = None
        limiter_redis: Redis | None = None
        if config.auth == "on":
            limiter_redis = make_limiter_redis(config.redis_url, config.ratelimit_redis_timeout_s)
            front_door = FrontDoor(
                config.region,
                KeyStore(redis, keys, refresh_s=config.key_refresh_s),
                RateLimiter(limiter_redis, keys, lease_fraction=config.ratelimit_lease_fraction),
                ConcurrencyLimiter(limiter_redis, keys, config.gateway_id),
                metrics,
            )
        metrics.add_state_collector(
            KVEventsCollector(
                self.kv_events,
                node_names=lambda: (
                    {node.id: node.name for node in store.table.snapshot.nodes} if store.table else {}
                ),
                cached_tokens=self.index.cached_token_totals,
            )
        )
        metrics.add_state_collector(
            StateCollector(
                inflight,
                node_names=lambda: (
                    {node.id: node.name for node in store.table.snapshot.nodes} if store.table else {}
                ),
                policy_version=lambda: store.table.version if store.table else None,
                redis_connected=lambda: store.redis_connected,
                policy_events=lambda: dict(store.events),
                request_log=lambda: (request_log.written, request_log.dropped, request_log.pending),
                chars_per_token=lambda: ratio.value,
                keyset_version=(lambda: front_door.store.version) if front_door is not None else None,
                breaker_states=breakers.states,
                client_stats=lambda: _client_stats_of(self.client_stats),
                timeouts=lambda: metrics.timeout_counts,
                queue_lengths=admission.lengths,
                measured=lambda: (measured.rtt_ms, measured.speeds),
                peer_staleness=lambda: (dict(sharing.peer_update_delay_s), dict(sharing.peer_report_age_s)),
            )
        )
        tracing = self.tracing or tracing_from_env(config.region, config.gateway_id)
        prober = NodeProber(breakers, client, lambda: store.table)
        proxy = Proxy(
            config,
            client,
            store,
            inflight,
            request_log,
            metrics,
            index,
            ratio,
            front_door,
            breakers,
            admission if admission.enabled else None,
            prober,
            tracing,
            tokenizers=self.tokenizers,
            measured=measured,
        )
        self.runtime = Runtime(
            redis,
            client,
            store,
            request_log,
            sharing,
            inflight,
            metrics,
            proxy,
            front_door,
            limiter_redis,
            prober,
            tracing,
        )
        self.handle.proxy = proxy
        if front_door is not None:
            # First, so their connections and scripts are warm by the first request: the awaits
            # below take a few round trips when Redis is in another region.
            front_door.limiter.start()
            front_door.concurrency.start()
        await store.start()
        if front_door is not None:
            await front_door.store.start()
        request_log.start()
        self.runtime.prober.start()
        await sharing.start()
        self._kv_report = asyncio.get_running_loop().create_task(
            report_kv_state(
                self.kv_events, redis, keys, config.gateway_id, config.region, self._kv_report_stop
            ),
            name="gorgo-kv-state-report",
        )
        # GC tuning, measured under load (benchmarks/gateway_overhead.py): with the default
        # gen0 threshold of 700, the objects of ~32 requests in flight keep crossing it, so a
        # collection ran every ~18 requests (~4% of CPU, 0.1-0.7 ms pauses). Refcounting frees
        # nearly everything a request allocates; a higher threshold leaves the collector for
        # the rare cycles. Freezing moves the start-up objects (modules, clients, the first
        # table) out of its sight, so the collections that still run stay short.
        gc.freeze()
        gc.set_threshold(_GC_GEN0_THRESHOLD, *gc.get_threshold()[1:])
        logger.info(
            "gateway %s (region %s) up; policy %s",
            config.gateway_id,
            config.region,
            f"v{store.table.version}" if store.table else "not loaded yet",
        )

    async def shutdown(self) -> None:
        runtime, self.runtime = self.runtime, None
        self.handle.proxy = None
        if runtime is None:
            return
        await runtime.store.close()
        if runtime.front_door is not None:
            await runtime.front_door.store.close()
            await runtime.front_door.limiter.close()
            await runtime.front_door.concurrency.close()
        await runtime.prober.close()
        await run_bounded(runtime.sharing.stop(), 3.0, "gorgo-sharing-stop")
        self._kv_report_stop.set()
        if self._kv_report is not None:
            await run_bounded(self._kv_report, 3.0, "gorgo-kv-state-report")
        await run_bounded(self.kv_events.close(), 3.0, "gorgo-kv-events-stop")
        self.tokenizers.close()
        await runtime.request_log.close()
        await runtime.client.close()
        await runtime.redis.aclose()
        if runtime.limiter_redis is not None:
            await runtime.limiter_redis.aclose()
        if runtime.tracing is not None:
            await run_bounded(asyncio.to_thread(runtime.tracing.shutdown), 5.0, "gorgo-tracing-flush")

    def _on_snapshot(self, table: RoutingTable) -> None:
        """A new snapshot: resize the index, load tokenizers, (re)subscribe to KV events."""
        _resize_index(self.index, table, self.chars_per_token)
        snapshot = table.snapshot
        self.inflight.set_node_regions({node.id: node.region for node in snapshot.nodes})
        files = {model.name: tokenizer_files(model) for model in snapshot.models}
        self.tokenizers.sync(
            {name: paths for name, paths in files.items() if paths is not None},
            lora_adapters={model.name for model in snapshot.models if model.lora_adapter},
        )
        # The block size the index keys a node's prompts with before its first event says it.
        block_sizes = {model.name: model.kv_block_size for model in snapshot.models}
        self.index.set_block_sizes(
            {
                node.id: block_sizes[node.models[0]]
                for node in snapshot.nodes
                if node.models and node.models[0] in block_sizes
            }
        )
        sources = {
            node.id: EventSource.of_node(node.kv_events, node.base_url)
            for node in snapshot.nodes
            if node.kv_events is not None
        }
        task = asyncio.get_running_loop().create_task(
            self.kv_events.sync(sources), name="gorgo-kv-events-sync"
        )
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- HTTP --------------------------------------------------------------------------------

    async def _handle(self, request: ClientRequest) -> None:
        """Answer a request ``handle`` (the ``Dispatch``) does not send to the proxy itself; never
        raises for a client's mistake: every error is an OpenAI-shaped answer."""
        path = request.path
        runtime = self.runtime
        if runtime is None:
            _send_error(request, GatewayError(503, "The gateway is starting.", retry_after_s=1))
            return
        endpoint = ENDPOINTS.get(path)
        method = request.method
        if endpoint is not None:
            if method != "POST":
                _send_error(
                    request, GatewayError(405, f"{path} accepts POST only.", extra_headers=[_ALLOW_POST])
                )
                return
            await runtime.proxy.handle(request, endpoint)
            return
        not_routed = _not_routed(path)
        if not_routed is not None:
            _send_error(request, not_routed)
            return
        if method not in ("GET", "HEAD"):
            if path in ("/v1/models", "/healthz", "/health", "/metrics") or path.startswith("/v1/models/"):
                _send_error(
                    request, GatewayError(405, f"{path} accepts GET only.", extra_headers=[_ALLOW_GET])
                )
            else:
                _send_error(request, _no_route(method, path))
            return
        table = runtime.store.table
        if (path == "/v1/models" or path.startswith("/v1/models/")) and runtime.front_door is not None:
            # Like vLLM with --api-key: the model list is for key holders only.
            try:
                runtime.front_door.authenticate(
                    scan_request_headers(request.headers, None, keep_credentials=False)
                )
            except GatewayError as exc:
                _send_error(request, exc)
                return
        if path == "/v1/models":
            if table is None:
                _send_error(request, GatewayError(503, "No routing policy loaded yet.", retry_after_s=1))
            else:
                request.respond(200, [JSON_CONTENT_TYPE], table.models_body)
        elif path.startswith("/v1/models/"):
            model = path.removeprefix("/v1/models/")
            body = table.model_bodies.get(model) if table is not None else None
            if table is None:
                _send_error(request, GatewayError(503, "No routing policy loaded yet.", retry_after_s=1))
            elif body is None:
                error = GatewayError(
                    404, f"The model `{model}` does not exist on this gateway.", param="model"
                )
                _send_error(request, error)
            else:
                request.respond(200, [JSON_CONTENT_TYPE], body)
        elif path in ("/healthz", "/health"):  # /health: vLLM's name, which tools like guidellm probe
            body = msgspec.json.encode(
                {
                    "status": "ok" if table is not None else "no policy",
                    "region": self.config.region,
                    "gateway_id": self.config.gateway_id,
                    "policy_version": table.version if table is not None else None,
                    "redis_connected": runtime.store.redis_connected,
                }
            )
            request.respond(200 if table is not None else 503, [JSON_CONTENT_TYPE], body)
        elif path == "/metrics":
            request.respond(200, [(b"content-type", CONTENT_TYPE.encode())], runtime.metrics.render())
        else:
            _send_error(request, _no_route(method, path))


def _no_route(method: str, path: str) -> GatewayError:
    return GatewayError(404, f"No route for {method} {path}. This gateway routes {_SUPPORTED}.")


def _send_error(request: ClientRequest, error: GatewayError) -> None:
    request.respond(error.status, error.headers(), error.body())


def _resize_index(index: PrefixIndex, table: RoutingTable, ratio: CharsPerToken) -> None:
    """A new snapshot may add, drop or resize nodes, or change the chars-per-token prior."""
    ratio.set_prior(table.chars_per_token)  # a new prior restarts learning; the same one keeps it
    index.set_chars_per_token(ratio.value)
    index.sync_nodes(table.snapshot.nodes)


def _client_stats_of(stats: ClientStats) -> tuple[int, int, int, int, int, int]:
    """A server's client-side counters (``routing.http.client_side``), in the collector's order."""
    return (
        len(stats.connections),
        stats.rejected_connections,
        stats.header_timeouts,
        stats.body_timeouts,
        stats.send_timeouts,
        stats.evicted_idle,
    )


def create_app(config: GatewayConfig | None = None) -> Gateway:
    """Build a gateway app; without a config, from the environment."""
    return Gateway(config if config is not None else GatewayConfig.from_env())
