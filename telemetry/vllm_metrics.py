"""vLLM ``/metrics`` parsing and the interval between two scrapes.

Parsing uses prometheus_client's own text parser; nothing here splits lines by hand. Each series
(one label set: ``engine``, ``model_name``, ``finished_reason``...) is kept on its own so that
deltas are taken per series and only then summed: with data parallelism one engine can restart
while the others keep counting, and a per-node sum would hide that engine's counter reset.

Names: fleets run mixed vLLM versions, so every quantity lists the names it has had, current
first (``vllm:kv_cache_usage_perc`` was ``vllm:gpu_cache_usage_perc``; the prefix-cache counters
were ``vllm:gpu_prefix_cache_{queries,hits}``; ``vllm:inter_token_latency_seconds`` was
``vllm:time_per_output_token_seconds``). Prefix-cache counters count tokens, not blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import msgspec
from prometheus_client.parser import text_string_to_metric_families

# quantity -> metric names, current first. Counters and histograms are named by their samples.
GAUGES: dict[str, tuple[str, ...]] = {
    "num_running": ("vllm:num_requests_running",),
    "num_waiting": ("vllm:num_requests_waiting",),
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
}
# Fractions are averaged over engines (each engine has its own KV cache); counts are summed.
MEAN_GAUGES = frozenset({"kv_cache_usage"})
COUNTERS: dict[str, tuple[str, ...]] = {
    "prefix_queries": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    "prefix_hits": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    "prompt_tokens": ("vllm:prompt_tokens_total",),
    "generation_tokens": ("vllm:generation_tokens_total",),
    "preemptions": ("vllm:num_preemptions_total",),
    "requests_finished": ("vllm:request_success_total",),
}
HISTOGRAMS: dict[str, tuple[str, ...]] = {
    "ttft": ("vllm:time_to_first_token_seconds",),
    "itl": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    "e2e": ("vllm:e2e_request_latency_seconds",),
    "queue": ("vllm:request_queue_time_seconds",),
    "prefill": ("vllm:request_prefill_time_seconds",),
    "decode": ("vllm:request_decode_time_seconds",),
}
QUANTILES: tuple[float, ...] = (0.5, 0.9, 0.99)
MAX_METRICS_BYTES = 8 * 1024 * 1024


class MetricsParseError(ValueError):
    """The body of /metrics is not Prometheus text, or has no vLLM metric in it."""


class SeriesHistogram(msgspec.Struct, frozen=True):
    """One histogram series, cumulative: counts at each finite upper bound, ``count`` at +Inf."""

    bounds: tuple[float, ...]
    cumulative: tuple[float, ...]
    count: float
    sum: float
    created: float | None = None


class Scrape(msgspec.Struct, frozen=True):
    """One scrape of a node, cumulative, per series. Kept in Redis as the baseline of the next one."""

    scraped_at: float  # unix seconds
    gauges: dict[str, float]
    counters: dict[str, dict[str, float]]  # quantity -> series id -> value
    counter_created: dict[str, dict[str, float]]  # quantity -> series id -> *_created
    histograms: dict[str, dict[str, SeriesHistogram]]  # quantity -> series id -> histogram
    sources: dict[str, str] = {}  # quantity -> the metric name it was read from


@dataclass(frozen=True, slots=True)
class HistogramInterval:
    """What one histogram observed between two scrapes (all series summed)."""

    bounds: tuple[float, ...]
    cumulative: tuple[float, ...]
    count: float
    sum_s: float

    @property
    def mean_ms(self) -> float | None:
        return self.sum_s / self.count * 1000.0 if self.count > 0 else None

    def quantile_ms(self, q: float) -> float | None:
        """Prometheus ``histogram_quantile``: linear inside the bucket; +Inf -> highest finite bound."""
        if self.count <= 0 or not self.bounds:
            return None
        rank = q * self.count
        lower_bound, lower_count = 0.0, 0.0
        for bound, cumulative in zip(self.bounds, self.cumulative, strict=True):
            if cumulative >= rank and cumulative > lower_count:
                if bound <= 0:
                    return bound * 1000.0
                fraction = (rank - lower_count) / (cumulative - lower_count)
                return (lower_bound + (bound - lower_bound) * fraction) * 1000.0
            lower_bound, lower_count = bound, cumulative
        return self.bounds[-1] * 1000.0

    def summary(self) -> dict[str, float | None]:
        """The JSON kept in ``MetricSample.latency``."""
        result: dict[str, float | None] = {"count": self.count, "mean_ms": _round(self.mean_ms)}
        for q in QUANTILES:
            result[f"p{round(q * 100)}_ms"] = _round(self.quantile_ms(q))
        return result


@dataclass(frozen=True, slots=True)
class MetricsInterval:
    """A node between two scrapes: gauges now, counter deltas and histogram deltas since before."""

    scrape: Scrape
    interval_s: float | None  # None: first scrape of the node, no deltas
    counters_reset: bool = False
    deltas: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, HistogramInterval] = field(default_factory=dict)

    def gauge(self, name: str) -> float | None:
        return self.scrape.gauges.get(name)

    def rate_per_s(self, name: str) -> float | None:
        delta = self.deltas.get(name)
        if delta is None or not self.interval_s:
            return None
        return delta / self.interval_s

    @property
    def prefix_hit_rate(self) -> float | None:
        """Hits over queries, in tokens, over the interval; None when nothing was queried."""
        queries, hits = self.deltas.get("prefix_queries"), self.deltas.get("prefix_hits")
        if not queries or hits is None:
            return None
        return min(1.0, max(0.0, hits / queries))

    def mean_ms(self, name: str) -> float | None:
        histogram = self.histograms.get(name)
        return histogram.mean_ms if histogram is not None else None

    def quantile_ms(self, name: str, q: float) -> float | None:
        histogram = self.histograms.get(name)
        return histogram.quantile_ms(q) if histogram is not None else None


def parse_metrics(text: str, scraped_at: float) -> Scrape:
    """Parse a vLLM /metrics page. Raises ``MetricsParseError`` with a readable reason."""
    if len(text) > MAX_METRICS_BYTES:
        raise MetricsParseError(f"metrics page is larger than {MAX_METRICS_BYTES} bytes")
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples.setdefault(sample.name, []).append((sample.labels, float(sample.value)))
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise MetricsParseError(f"not Prometheus text format: {_shorten(str(exc))}") from None
    if not any(name.startswith("vllm:") for name in samples):
        raise MetricsParseError("no vLLM metrics (vllm:*) in the page")

    sources: dict[str, str] = {}
    gauges: dict[str, float] = {}
    for quantity, names in GAUGES.items():
        name, series = _first_present(samples, names)
        if name is None:
            continue
        values = [value for _labels, value in series if math.isfinite(value)]
        if values:
            gauges[quantity] = sum(values) / len(values) if quantity in MEAN_GAUGES else sum(values)
            sources[quantity] = name

    counters: dict[str, dict[str, float]] = {}
    counter_created: dict[str, dict[str, float]] = {}
    for quantity, names in COUNTERS.items():
        name, series = _first_present(samples, names)
        if name is None:
            continue
        counters[quantity] = {_series_id(labels): value for labels, value in series if math.isfinite(value)}
        created = samples.get(name.removesuffix("_total") + "_created", [])
        counter_created[quantity] = {_series_id(labels): value for labels, value in created}
        sources[quantity] = name

    histograms: dict[str, dict[str, SeriesHistogram]] = {}
    for quantity, names in HISTOGRAMS.items():
        name = next((n for n in names if f"{n}_bucket" in samples or f"{n}_count" in samples), None)
        if name is None:
            continue
        histograms[quantity] = _histogram_series(samples, name)
        sources[quantity] = name

    return Scrape(
        scraped_at=scraped_at,
        gauges=gauges,
        counters=counters,
        counter_created=counter_created,
        histograms=histograms,
        sources=sources,
    )


def interval_between(previous: Scrape | None, current: Scrape) -> MetricsInterval:
    """Deltas from ``previous`` to ``current``; a series that went backwards restarted from zero."""
    if previous is None or current.scraped_at <= previous.scraped_at:
        return MetricsInterval(scrape=current, interval_s=None)
    reset = False
    deltas: dict[str, float] = {}
    for quantity, series in current.counters.items():
        before = previous.counters.get(quantity)
        if before is None:
            continue  # first time this node reports it: no baseline yet
        created_now = current.counter_created.get(quantity, {})
        created_before = previous.counter_created.get(quantity, {})
        total = 0.0
        for series_id, value in series.items():
            old = before.get(series_id)
            restarted = old is not None and (
                value < old or _changed(created_before.get(series_id), created_now.get(series_id))
            )
            reset |= restarted
            total += value if old is None or restarted else value - old
        deltas[quantity] = total

    histograms: dict[str, HistogramInterval] = {}
    for quantity, series in current.histograms.items():
        before = previous.histograms.get(quantity)
        if before is None:
            continue
        parts: list[SeriesHistogram] = []
        for series_id, histogram in series.items():
            old = before.get(series_id)
            if old is None:
                parts.append(histogram)
            elif _histogram_restarted(old, histogram):
                reset = True
                parts.append(histogram)
            else:
                parts.append(_subtract(histogram, old))
        merged = _merge(parts)
        if merged is not None:
            histograms[quantity] = merged

    return MetricsInterval(
        scrape=current,
        interval_s=current.scraped_at - previous.scraped_at,
        counters_reset=reset,
        deltas=deltas,
        histograms=histograms,
    )


def _first_present(
    samples: dict[str, list[tuple[dict[str, str], float]]], names: tuple[str, ...]
) -> tuple[str | None, list[tuple[dict[str, str], float]]]:
    for name in names:
        if name in samples:
            return name, samples[name]
    return None, []


def _series_id(labels: dict[str, str]) -> str:
    """A stable identity for a label set (``le`` excluded: it indexes buckets, not series)."""
    return ",".join(f"{key}={labels[key]}" for key in sorted(labels) if key != "le")


def _histogram_series(
    samples: dict[str, list[tuple[dict[str, str], float]]], name: str
) -> dict[str, SeriesHistogram]:
    buckets: dict[str, dict[float, float]] = {}
    for labels, value in samples.get(f"{name}_bucket", []):
        try:
            bound = float(labels.get("le", "nan"))
        except ValueError:
            continue
        if not math.isnan(bound):
            buckets.setdefault(_series_id(labels), {})[bound] = value
    counts = {_series_id(labels): value for labels, value in samples.get(f"{name}_count", [])}
    sums = {_series_id(labels): value for labels, value in samples.get(f"{name}_sum", [])}
    created = {_series_id(labels): value for labels, value in samples.get(f"{name}_created", [])}
    result: dict[str, SeriesHistogram] = {}
    for series_id in set(buckets) | set(counts):
        by_bound = buckets.get(series_id, {})
        finite = sorted(bound for bound in by_bound if math.isfinite(bound))
        count = by_bound.get(math.inf, counts.get(series_id, by_bound[finite[-1]] if finite else 0.0))
        result[series_id] = SeriesHistogram(
            bounds=tuple(finite),
            cumulative=tuple(by_bound[bound] for bound in finite),
            count=count,
            sum=sums.get(series_id, 0.0),
            created=created.get(series_id),
        )
    return result


def _changed(before: float | None, now: float | None) -> bool:
    return before is not None and now is not None and before != now


def _histogram_restarted(old: SeriesHistogram, new: SeriesHistogram) -> bool:
    if new.count < old.count or _changed(old.created, new.created) or new.bounds != old.bounds:
        return True
    return any(after < before for after, before in zip(new.cumulative, old.cumulative, strict=True))


def _subtract(new: SeriesHistogram, old: SeriesHistogram) -> SeriesHistogram:
    return SeriesHistogram(
        bounds=new.bounds,
        cumulative=tuple(a - b for a, b in zip(new.cumulative, old.cumulative, strict=True)),
        count=new.count - old.count,
        sum=max(0.0, new.sum - old.sum),
    )


def _merge(parts: list[SeriesHistogram]) -> HistogramInterval | None:
    """Sum series bucket by bucket (series of one vLLM histogram share their bucket bounds)."""
    if not parts:
        return None
    bounds = max((part.bounds for part in parts), key=len)
    cumulative = [0.0] * len(bounds)
    for part in parts:
        if part.bounds == bounds:
            for index, value in enumerate(part.cumulative):
                cumulative[index] += value
        else:  # odd exporter: read its cumulative step function at the shared bounds
            for index, target in enumerate(bounds):
                below = [
                    value
                    for bound, value in zip(part.bounds, part.cumulative, strict=True)
                    if bound <= target
                ]
                cumulative[index] += below[-1] if below else 0.0
    return HistogramInterval(
        bounds=bounds,
        cumulative=tuple(cumulative),
        count=sum(part.count for part in parts),
        sum_s=sum(part.sum for part in parts),
    )


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _shorten(message: str, limit: int = 160) -> str:
    return message if len(message) <= limit else message[: limit - 1] + "…"
