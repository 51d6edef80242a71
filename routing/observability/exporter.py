"""Prometheus metrics of one gateway process (``GET /metrics``).

Counters and histograms are updated on the request path through cached label children (a dict
lookup, not prometheus_client's locked ``labels()`` call). Gauges that mirror state the gateway
already keeps (in-flight per node, policy version, request-log backlog) are read at scrape time by
a collector, so they cost nothing per request.

With ``GORGO_GATEWAY_WORKERS`` > 1 each worker process answers with its own numbers; scrape one
port per worker, or run one worker per port, when exact totals matter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from routing.state.inflight import InFlight

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_DECISION_BUCKETS_S = (5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 1e-2)

NO_NODE = "none"  # the node label of requests that never reached one (4xx, 503)


class GatewayMetrics:
    """The gateway's metrics in a registry of its own (no process-global state)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._requests = Counter(
            "gorgo_gateway_requests",
            "Finished requests by node and HTTP status.",
            ("node", "status"),
            registry=self.registry,
        )
        self._ttft = Histogram(
            "gorgo_gateway_ttft_seconds",
            "Gateway arrival to first byte sent to the client.",
            ("node",),
            buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self._duration = Histogram(
            "gorgo_gateway_request_duration_seconds",
            "Gateway arrival to last byte sent to the client (end to end).",
            ("node",),
            buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self._decision = Histogram(
            "gorgo_gateway_routing_decision_seconds",
            "Time to choose a node (view building, prefix match and algorithm).",
            buckets=_DECISION_BUCKETS_S,
            registry=self.registry,
        )
        self._upstream_errors = Counter(
            "gorgo_gateway_upstream_errors",
            "Failures talking to a node, by kind (connect, timeout, disconnect).",
            ("node", "kind"),
            registry=self.registry,
        )
        self._auth_failures = Counter(
            "gorgo_gateway_auth_failures",
            "Requests refused for their client key, by reason.",
            ("reason",),
            registry=self.registry,
        )
        self._rate_limited = Counter(
            "gorgo_gateway_rate_limited",
            "Requests refused by a client key's limits (429), by key and reason.",
            ("key_id", "reason"),
            registry=self.registry,
        )
        self._key_requests = Counter(
            "gorgo_gateway_key_requests",
            "Finished requests per client key, priority class and status class.",
            ("key_id", "priority", "status_class"),
            registry=self.registry,
        )
        # Timeouts of nodes (counted here) and of clients (counted by the server protocol) are one
        # family, gorgo_gateway_timeouts_total{kind}, written at scrape time by the StateCollector.
        self.timeout_counts: dict[str, int] = {}
        self._retries = Counter(
            "gorgo_gateway_retries",
            "Requests sent again to a node before any byte reached the client, by the first failure.",
            ("reason",),
            registry=self.registry,
        )
        self._queue_wait = Histogram(
            "gorgo_gateway_queue_wait_seconds",
            "Time requests waited for a node with room, by priority class.",
            ("priority",),
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=self.registry,
        )
        self._queue_rejected = Counter(
            "gorgo_gateway_queue_rejected",
            "Requests refused (503) by the admission queue, by priority and reason (full, timeout).",
            ("priority", "reason"),
            registry=self.registry,
        )
        self._key_children: dict[tuple[str, str, int], Counter] = {}
        self._request_children: dict[tuple[str, int], Counter] = {}
        self._ttft_children: dict[str, Histogram] = {}
        self._duration_children: dict[str, Histogram] = {}
        self.observe_decision = self._decision.observe

    def observe_request(self, node: str, status: int, ttft_s: float | None, total_s: float) -> None:
        """Count one finished request and record its latencies."""
        key = (node, status)
        counter = self._request_children.get(key)
        if counter is None:
            counter = self._request_children[key] = self._requests.labels(node, str(status))
        counter.inc()
        duration = self._duration_children.get(node)
        if duration is None:
            duration = self._duration_children[node] = self._duration.labels(node)
        duration.observe(total_s)
        if ttft_s is not None:
            ttft = self._ttft_children.get(node)
            if ttft is None:
                ttft = self._ttft_children[node] = self._ttft.labels(node)
            ttft.observe(ttft_s)

    def queue_wait(self, priority: str, seconds: float) -> None:
        self._queue_wait.labels(priority).observe(seconds)

    def queue_rejected(self, priority: str, reason: str) -> None:
        self._queue_rejected.labels(priority, reason).inc()

    def timeout(self, kind: str) -> None:
        self.timeout_counts[kind] = self.timeout_counts.get(kind, 0) + 1

    def retry(self, reason: str) -> None:
        self._retries.labels(reason).inc()

    def auth_failure(self, reason: str) -> None:
        self._auth_failures.labels(reason).inc()

    def rate_limited(self, key_id: str, reason: str) -> None:
        self._rate_limited.labels(key_id, reason).inc()

    def key_request(self, key_id: str, priority: str, status: int) -> None:
        status_class = status // 100
        child_key = (key_id, priority, status_class)
        counter = self._key_children.get(child_key)
        if counter is None:
            counter = self._key_children[child_key] = self._key_requests.labels(
                key_id, priority, f"{status_class}xx"
            )
        counter.inc()

    def upstream_error(self, node: str, kind: str) -> None:
        self._upstream_errors.labels(node, kind).inc()

    def add_state_collector(self, collector: Collector) -> None:
        self.registry.register(collector)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StateCollector(Collector):
    """Scrape-time gauges over state the gateway keeps anyway."""

    def __init__(
        self,
        inflight: InFlight,
        node_names: Callable[[], dict[int, str]],
        policy_version: Callable[[], int | None],
        redis_connected: Callable[[], bool],
        policy_events: Callable[[], dict[str, int]],
        request_log: Callable[[], tuple[int, int, int]],
        chars_per_token: Callable[[], float] | None = None,
        keyset_version: Callable[[], int | None] | None = None,
        breaker_states: Callable[[], dict[int, int]] | None = None,
        client_stats: Callable[[], tuple[int, int, int, int, int, int]] | None = None,
        timeouts: Callable[[], dict[str, int]] | None = None,
        queue_lengths: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        self._queue_lengths = queue_lengths
        self._client_stats = client_stats
        self._timeouts = timeouts
        self._keyset_version = keyset_version
        self._breaker_states = breaker_states
        self._inflight = inflight
        self._chars_per_token = chars_per_token
        self._node_names = node_names
        self._policy_version = policy_version
        self._redis_connected = redis_connected
        self._policy_events = policy_events
        self._request_log = request_log

    def describe(self) -> list[Metric]:
        return []  # only known at scrape time; empty keeps registration cheap

    def collect(self) -> Iterator[Metric]:
        names = self._node_names()
        requests = GaugeMetricFamily(
            "gorgo_gateway_inflight_requests", "Requests this gateway has open per node.", labels=["node"]
        )
        prefill = GaugeMetricFamily(
            "gorgo_gateway_inflight_prefill_tokens",
            "Estimated prompt tokens sent to a node and not yet answered with a first byte.",
            labels=["node"],
        )
        prefill_tokens = self._inflight.outstanding_prefill_tokens()
        for node_id, count in sorted(self._inflight.outstanding_requests().items()):
            name = names.get(node_id, str(node_id))
            requests.add_metric([name], count)
            prefill.add_metric([name], prefill_tokens.get(node_id, 0))
        yield requests
        yield prefill
        if self._breaker_states is not None:
            breakers = GaugeMetricFamily(
                "gorgo_gateway_breaker_state",
                "Circuit breaker per node: 0 closed, 1 half-open, 2 open.",
                labels=["node"],
            )
            states = self._breaker_states()
            for node_id, name in sorted(names.items()):
                breakers.add_metric([name], states.get(node_id, 0))
            yield breakers
        version = self._policy_version()
        yield GaugeMetricFamily(
            "gorgo_gateway_policy_version",
            "Version of the policy snapshot in use (-1: none loaded yet).",
            value=-1 if version is None else version,
        )
        yield GaugeMetricFamily(
            "gorgo_gateway_redis_connected",
            "1 while the policy subscription to Redis is up.",
            value=1 if self._redis_connected() else 0,
        )
        if self._chars_per_token is not None:
            yield GaugeMetricFamily(
                "gorgo_gateway_chars_per_token",
                "Prompt characters per node token the gateway estimates with (learned from usage).",
                value=self._chars_per_token(),
            )
        if self._queue_lengths is not None:
            lengths = GaugeMetricFamily(
                "gorgo_gateway_queue_length",
                "Requests waiting for a node with room, by priority class.",
                labels=["priority"],
            )
            for priority, length in sorted(self._queue_lengths().items()):
                lengths.add_metric([priority], length)
            yield lengths
        timeouts = dict(self._timeouts()) if self._timeouts is not None else {}
        if self._client_stats is not None:
            open_now, rejected, header_timeouts, body_timeouts, send_timeouts, evicted = self._client_stats()
            timeouts["header_read"] = header_timeouts
            timeouts["body_read"] = body_timeouts
            timeouts["client_send"] = send_timeouts
            yield GaugeMetricFamily(
                "gorgo_gateway_connections_open", "Client connections open now.", value=open_now
            )
            yield CounterMetricFamily(
                "gorgo_gateway_connections_rejected",
                "Client connections refused (503): at GORGO_MAX_CONNECTIONS or "
                "GORGO_MAX_CONNECTIONS_PER_ADDRESS with no idle connection to close.",
                value=rejected,
            )
            yield CounterMetricFamily(
                "gorgo_gateway_connections_closed_idle",
                "Idle client connections closed to make room for a new one.",
                value=evicted,
            )
        if timeouts:
            family = CounterMetricFamily(
                "gorgo_gateway_timeouts",
                "Timeouts: first_byte, idle, connect (nodes); header_read, body_read (clients).",
                labels=["kind"],
            )
            for kind, count in sorted(timeouts.items()):
                family.add_metric([kind], count)
            yield family
        if self._keyset_version is not None:
            keyset = self._keyset_version()
            yield GaugeMetricFamily(
                "gorgo_gateway_keyset_version",
                "Version of the client key set in use (-1: none loaded yet).",
                value=-1 if keyset is None else keyset,
            )
        events = CounterMetricFamily(
            "gorgo_gateway_policy_events",
            "Policy snapshots swapped in, and refused by reason.",
            labels=["event"],
        )
        for event, count in sorted(self._policy_events().items()):
            events.add_metric([event], count)
        yield events
        written, dropped, pending = self._request_log()
        yield CounterMetricFamily(
            "gorgo_gateway_request_log_written", "Request records written to Redis.", value=written
        )
        yield CounterMetricFamily(
            "gorgo_gateway_request_log_dropped",
            "Request records dropped because Redis was slow or down.",
            value=dropped,
        )
        yield GaugeMetricFamily(
            "gorgo_gateway_request_log_pending", "Request records waiting for the next flush.", value=pending
        )
