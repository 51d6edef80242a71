"""Scrape-time Prometheus metrics of a gateway's KV-event subscribers and its cache predictions."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from routing.cache.kv_events.manager import KVEvents


class KVEventsCollector(Collector):
    """Scrape-time metrics of the subscribers (names fixed in COORDINATION.md)."""

    def __init__(
        self,
        events: KVEvents,
        node_names: Callable[[], dict[int, str]],
        cached_tokens: Callable[[], Iterable[tuple[int, str, int, int]]] = tuple,
    ) -> None:
        self._events = events
        self._node_names = node_names
        self._cached_tokens = cached_tokens

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        names = self._node_names()
        now = self._events.now()
        received = CounterMetricFamily(
            "gorgo_kv_events_received", "KV events received from each node.", labels=["node"]
        )
        applied = CounterMetricFamily(
            "gorgo_kv_events_applied", "KV events applied to the precise index.", labels=["node"]
        )
        dropped = CounterMetricFamily(
            "gorgo_kv_events_dropped", "KV events not applied, by reason.", labels=["node", "reason"]
        )
        gaps = CounterMetricFamily(
            "gorgo_kv_event_sequence_gaps", "Sequence gaps in a node's event stream.", labels=["node"]
        )
        restarts = CounterMetricFamily(
            "gorgo_kv_event_publisher_restarts",
            "Times a node's event sequence went back (a restarted vLLM; its index was emptied).",
            labels=["node"],
        )
        blocks = GaugeMetricFamily(
            "gorgo_kv_index_blocks", "Blocks the precise index holds per node.", labels=["node"]
        )
        lag = GaugeMetricFamily(
            "gorgo_kv_event_lag_seconds", "Age of the node's last event batch on arrival.", labels=["node"]
        )
        mode = GaugeMetricFamily(
            "gorgo_kv_index_precise",
            "1 while the node is routed on its events, 0 approximate.",
            labels=["node"],
        )
        silent = GaugeMetricFamily(
            "gorgo_kv_events_silent",
            "1 while the node answered requests through this gateway and sent no KV event for a "
            "while (its events do not arrive: check the endpoint shape), else 0.",
            labels=["node"],
        )
        for node_id, subscriber in sorted(self._events.subscribers.items()):
            name = names.get(node_id, str(node_id))
            stats = subscriber.stats
            received.add_metric([name], stats.received)
            applied.add_metric([name], stats.applied)
            for reason, count in sorted(stats.dropped.items()):
                dropped.add_metric([name, reason], count)
            gaps.add_metric([name], stats.gaps)
            restarts.add_metric([name], stats.restarts)
            blocks.add_metric([name], self._events.index.blocks(node_id))
            if stats.last_lag_s is not None:
                lag.add_metric([name], stats.last_lag_s)
            mode.add_metric([name], 1 if subscriber.mode(now) == "precise" else 0)
            silent.add_metric([name], 1 if subscriber.silent(now) else 0)
        yield from (received, applied, dropped, gaps, restarts, blocks, lag, mode, silent)
        predicted = CounterMetricFamily(
            "gorgo_prefix_predicted_cached_tokens",
            "Cached prompt tokens the index predicted for the chosen node.",
            labels=["node", "mode"],
        )
        actual = CounterMetricFamily(
            "gorgo_prefix_actual_cached_tokens",
            "Cached prompt tokens the node reported (usage.prompt_tokens_details.cached_tokens).",
            labels=["node", "mode"],
        )
        for node_id, index_mode, predicted_tokens, actual_tokens in self._cached_tokens():
            name = names.get(node_id, str(node_id))
            predicted.add_metric([name, index_mode], predicted_tokens)
            actual.add_metric([name, index_mode], actual_tokens)
        yield predicted
        yield actual
