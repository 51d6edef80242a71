"""Prometheus metrics of one gateway process (``GET /metrics``).

The counters and histograms updated per request are plain numbers, not prometheus_client's
metric objects: every update there takes a ``threading.Lock`` (a histogram also walks its buckets
in Python), ~7 µs a request in the profile (docs/gateway.md). The gateway updates its metrics on
its one event-loop thread only, so a float per label set (and a bucket list per histogram child,
found by bisection) needs no lock; the families are rendered at scrape time with the names,
labels, values and ``_created`` series prometheus_client's own objects would write, so nothing is
ever pending: a scrape sees every request finished before it. Gauges that mirror state the gateway
already keeps (in-flight per node, policy version, request-log backlog) are read at scrape time by
a collector too.

With ``GORGO_GATEWAY_WORKERS`` > 1 each worker process answers with its own numbers; scrape one
port per worker, or run one worker per port, when exact totals matter.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from routing.state.inflight import InFlight

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_DECISION_BUCKETS_S = (5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 1e-2)
_QUEUE_WAIT_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

NO_NODE: Final = "none"  # the node label of requests that never reached one (4xx, 503)


def _created_series() -> bool:
    # prometheus_client's own switch (PROMETHEUS_DISABLE_CREATED_SERIES), so the output matches
    # what its metric objects would write either way.
    return bool(getattr(prometheus_metrics, "_use_created", True))


def _as_labels(key: Any) -> Sequence[str]:
    return (key,) if isinstance(key, str) else key


def _request_labels(key: tuple[str, int]) -> tuple[str, str]:
    return key[0], str(key[1])


def _key_request_labels(key: tuple[str, str, int]) -> tuple[str, str, str]:
    return key[0], key[1], f"{key[2]}xx"


class LoopCounter(Collector):
    """A labelled counter family as a float per label set, for the event-loop thread only (no lock).

    ``inc`` takes the labels as the caller has them (``key``: a string for one label, else a
    tuple); ``label_values`` turns a key into the label strings once per label set, on its first use.
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        label_values: Callable[[Any], Sequence[str]] | None = None,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._label_values = label_values or _as_labels
        # key -> [value, created (unix s), label values]
        self.children: dict[Any, list[Any]] = {}

    def inc(self, key: Any, amount: float = 1.0) -> None:
        child = self.children.get(key)
        if child is None:
            labels = dict(zip(self.labelnames, self._label_values(key), strict=True))
            child = self.children[key] = [0.0, time.time(), labels]
        child[0] += amount

    def describe(self) -> list[Metric]:
        return []  # registration stays cheap; the names are fixed by the constructor

    def collect(self) -> Iterator[Metric]:
        family = Metric(self.name, self.documentation, "counter")
        created = _created_series()
        for value, created_s, labels in self.children.values():
            family.add_sample(self.name + "_total", labels, value)
            if created:
                family.add_sample(self.name + "_created", labels, created_s)
        yield family


class _HistogramChild:
    """One label set's bucket counts (not cumulative), sum, creation time and labels."""

    __slots__ = ("counts", "created_s", "labels", "total")

    def __init__(self, buckets: int, labels: dict[str, str]) -> None:
        self.counts = [0] * buckets
        self.total = 0.0
        self.created_s = time.time()
        self.labels = labels


class LoopHistogram(Collector):
    """A histogram family as bucket counts and a sum per label set, for the event-loop thread only.

    ``observe`` finds the bucket by bisection (the first bound >= the value, as prometheus_client's
    ``amount <= bound``) and adds to it; cumulative counts are summed at scrape time. Keys are as
    ``LoopCounter``'s. Without labels the one child (key ``()``) exists from the start, as
    prometheus_client's does. The bisection is written out over typed floats, and a child is a
    small class, not a list of objects: compiled, ``bisect_left`` is a generic call and every item
    of an ``Any`` list a boxed object (~1.9 k instructions an observation, 3 a request; ~0.5 k).
    """

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float]
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.bounds: tuple[float, ...] = (*buckets, float("inf"))
        self._le = tuple(floatToGoString(bound) for bound in self.bounds)
        self.children: dict[Any, _HistogramChild] = {}
        if not self.labelnames:
            self._child(())

    def _child(self, key: Any) -> _HistogramChild:
        labels = dict(zip(self.labelnames, _as_labels(key), strict=True))
        child = self.children[key] = _HistogramChild(len(self.bounds), labels)
        return child

    def observe(self, key: Any, amount: float) -> None:
        child = self.children.get(key)
        if child is None:
            child = self._child(key)
        bounds = self.bounds
        low = 0
        high = len(bounds)
        while low < high:  # bisect_left: the first bound >= amount (the last is +inf)
            middle = (low + high) // 2
            if bounds[middle] < amount:
                low = middle + 1
            else:
                high = middle
        child.counts[low] += 1
        child.total += amount

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        family = Metric(self.name, self.documentation, "histogram")
        created = _created_series()
        for child in self.children.values():
            labels = child.labels
            accumulated = 0.0
            for le, count in zip(self._le, child.counts, strict=True):
                accumulated += count
                family.add_sample(self.name + "_bucket", {**labels, "le": le}, accumulated)
            family.add_sample(self.name + "_count", labels, accumulated)
            if self.bounds[0] >= 0:
                family.add_sample(self.name + "_sum", labels, child.total)
            if created:
                family.add_sample(self.name + "_created", labels, child.created_s)
        yield family


class GatewayMetrics:
    """The gateway's metrics in a registry of its own (no process-global state).

    Update them from the event loop's thread only (every caller is on the request path or in a
    background task of that loop).
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._requests = LoopCounter(
            "gorgo_gateway_requests",
            "Finished requests by node and HTTP status.",
            ("node", "status"),
            _request_labels,
        )
        self._ttft = LoopHistogram(
            "gorgo_gateway_ttft_seconds",
            "Gateway arrival to first byte sent to the client.",
            ("node",),
            _LATENCY_BUCKETS_S,
        )
        self._duration = LoopHistogram(
            "gorgo_gateway_request_duration_seconds",
            "Gateway arrival to last byte sent to the client (end to end).",
            ("node",),
            _LATENCY_BUCKETS_S,
        )
        self._decision = LoopHistogram(
            "gorgo_gateway_routing_decision_seconds",
            "Time to choose a node (view building, prefix match and algorithm).",
            (),
            _DECISION_BUCKETS_S,
        )
        self._upstream_errors = LoopCounter(
            "gorgo_gateway_upstream_errors",
            "Failures talking to a node, by kind (connect, timeout, disconnect).",
            ("node", "kind"),
        )
        self._auth_failures = LoopCounter(
            "gorgo_gateway_auth_failures", "Requests refused for their client key, by reason.", ("reason",)
        )
        self._rate_limited = LoopCounter(
            "gorgo_gateway_rate_limited",
            "Requests refused by a client key's limits (429), by key and reason.",
            ("key_id", "reason"),
        )
        self._key_requests = LoopCounter(
            "gorgo_gateway_key_requests",
            "Finished requests per client key, priority class and status class.",
            ("key_id", "priority", "status_class"),
            _key_request_labels,
        )
        # Timeouts of nodes (counted here) and of clients (counted by the server protocol) are one
        # family, gorgo_gateway_timeouts_total{kind}, written at scrape time by the StateCollector.
        self.timeout_counts: dict[str, int] = {}
        self._retries = LoopCounter(
            "gorgo_gateway_retries",
            "Requests sent again to a node before any byte reached the client, by the first failure.",
            ("reason",),
        )
        self._queue_wait = LoopHistogram(
            "gorgo_gateway_queue_wait_seconds",
            "Time requests waited for a node with room, by priority class.",
            ("priority",),
            _QUEUE_WAIT_BUCKETS_S,
        )
        self._queue_rejected = LoopCounter(
            "gorgo_gateway_queue_rejected",
            "Requests refused (503) by the admission queue, by priority and reason (full, timeout).",
            ("priority", "reason"),
        )
        # gorgo's homing (routing/state/homing.py): what forwards for prefixes held only abroad paid,
        # and how many such prefixes were brought home
        self._prefix_rent = LoopCounter(
            "gorgo_gateway_prefix_rent_seconds",
            "Estimated TTFT that requests sent abroad for a prefix their region does not hold paid "
            "for it (gorgo's homing rent).",
            (),
        )
        self._prefixes_homed = LoopCounter(
            "gorgo_gateway_prefixes_homed",
            "Prompt prefixes held only abroad that a request stayed home to cache (gorgo's homing).",
            (),
        )
        # Without labels a counter has its one series from the start, as prometheus_client's does.
        self._prefix_rent.inc((), 0.0)
        self._prefixes_homed.inc((), 0.0)
        for family in (
            self._requests,
            self._ttft,
            self._duration,
            self._decision,
            self._upstream_errors,
            self._auth_failures,
            self._rate_limited,
            self._key_requests,
            self._retries,
            self._queue_wait,
            self._queue_rejected,
            self._prefix_rent,
            self._prefixes_homed,
        ):
            self.registry.register(family)

    def observe_request(self, node: str, status: int, ttft_s: float | None, total_s: float) -> None:
        """Count one finished request and record its latencies."""
        self._requests.inc((node, status))
        self._duration.observe(node, total_s)
        if ttft_s is not None:
            self._ttft.observe(node, ttft_s)

    def observe_decision(self, seconds: float) -> None:
        self._decision.observe((), seconds)

    def prefix_rent(self, rent_ms: float) -> None:
        self._prefix_rent.inc((), rent_ms / 1000.0)

    def prefix_homed(self) -> None:
        self._prefixes_homed.inc(())

    def queue_wait(self, priority: str, seconds: float) -> None:
        self._queue_wait.observe(priority, seconds)

    def queue_rejected(self, priority: str, reason: str) -> None:
        self._queue_rejected.inc((priority, reason))

    def timeout(self, kind: str) -> None:
        self.timeout_counts[kind] = self.timeout_counts.get(kind, 0) + 1

    def retry(self, reason: str) -> None:
        self._retries.inc(reason)

    def auth_failure(self, reason: str) -> None:
        self._auth_failures.inc(reason)

    def rate_limited(self, key_id: str, reason: str) -> None:
        self._rate_limited.inc((key_id, reason))

    def key_request(self, key_id: str, priority: str, status: int) -> None:
        self._key_requests.inc((key_id, priority, status // 100))

    def upstream_error(self, node: str, kind: str) -> None:
        self._upstream_errors.inc((node, kind))

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
        measured: Callable[[], tuple[dict[int, float], dict[int, float]]] | None = None,
        peer_staleness: Callable[[], tuple[dict[str, float], dict[str, float]]] | None = None,
    ) -> None:
        self._measured = measured
        self._peer_staleness = peer_staleness
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
        if self._measured is not None:
            rtt_ms, ms_per_token = self._measured()
            rtt = GaugeMetricFamily(
                "gorgo_gateway_node_measured_rtt_seconds",
                "Round trip to a node as this gateway measures it (request sent to a stream's response "
                "head, a low quantile); gorgo routes on it in place of the probed RTT.",
                labels=["node"],
            )
            for node_id, value in sorted(rtt_ms.items()):
                rtt.add_metric([names.get(node_id, str(node_id))], value / 1000.0)
            yield rtt
            speed = GaugeMetricFamily(
                "gorgo_gateway_node_measured_prefill_tokens_per_second",
                "Prefill speed of a node as this gateway measures it (from its answers' head to first "
                "token); gorgo routes on it in place of the configured speed.",
                labels=["node"],
            )
            for node_id, value in sorted(ms_per_token.items()):
                speed.add_metric([names.get(node_id, str(node_id))], 1000.0 / value)
            yield speed
        if self._peer_staleness is not None:
            update_delay_s, report_age_s = self._peer_staleness()
            delay = GaugeMetricFamily(
                "gorgo_gateway_peer_update_delay_seconds",
                "How late a peer gateway's prefix updates (each also a claim on a node's queue) arrive "
                "here, smoothed: work a peer sent more recently is not in this gateway's view of the "
                "nodes yet.",
                labels=["peer"],
            )
            for peer, value in sorted(update_delay_s.items()):
                delay.add_metric([peer], value)
            yield delay
            age = GaugeMetricFamily(
                "gorgo_gateway_peer_load_age_seconds",
                "Age of a peer gateway's load report when this gateway last read it.",
                labels=["peer"],
            )
            for peer, value in sorted(report_age_s.items()):
                age.add_metric([peer], value)
            yield age
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
