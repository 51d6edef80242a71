"""Chart-ready data for the dashboard pages, read from telemetry's history tables.

Telemetry stores 10 s and 1 min request buckets (sums and a log-bucketed TTFT histogram) and one
metric sample per node per scrape. A chart wants a window merged into a few hundred points at
most, with percentiles over the merged buckets: that merging is done here, on the server, with
telemetry's own quantile and breakdown functions, so a 24 h chart costs the browser ~150 points
per line instead of thousands of raw rows.

Every timestamp is unix seconds, every duration milliseconds, every ratio 0..1.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import msgspec

from controlplane.histogram import add_to_histogram, histogram_quantile_ms
from controlplane.keys.models import ClientKey
from telemetry.aggregation import SUMMED_FIELDS, breakdown_of, prediction_quality
from telemetry.choices import ScopeChoices
from telemetry.keyusage import KEY_USAGE_SUMMED_FIELDS
from telemetry.models import KeyUsageAggregate, MetricSample, RequestAggregate

COMPONENTS = ("gateway", "network", "queue", "prefill", "other")
HEADLINE_WINDOW_S = 60
MAX_POINTS = 180


@dataclass(frozen=True, slots=True)
class Window:
    """A time range, the bucket resolution it reads and the step its series are merged to."""

    key: str
    seconds: int
    resolution: str
    step_s: int

    @classmethod
    def of(cls, key: str, seconds: int, resolution: str) -> Window:
        width_s = 10 if resolution == "10s" else 60
        steps = max(1, -(-seconds // (width_s * MAX_POINTS)))  # ceil: at most MAX_POINTS points
        return cls(key=key, seconds=seconds, resolution=resolution, step_s=width_s * steps)


@dataclass(slots=True)
class Merged:
    """Buckets added together: the sums telemetry keeps (``SUMMED_FIELDS``) and the TTFT histogram."""

    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SUMMED_FIELDS, 0))
    histogram: dict[str, int] = field(default_factory=dict)
    prediction_histogram: dict[str, int] = field(default_factory=dict)
    bucket_means: list[tuple[int, dict[str, float]]] = field(default_factory=list)

    @property
    def count(self) -> int:
        return int(self.sums["count"])

    @property
    def errors(self) -> int:
        """Server-side failures: 5xx and no answer."""
        return int(self.sums["errors"])

    @property
    def client_errors(self) -> int:
        """4xx answers."""
        return int(self.sums["client_errors"])

    def add(self, row: dict[str, Any]) -> None:
        for name in SUMMED_FIELDS:
            self.sums[name] += row[name] or 0
        for index, count in (row["ttft_histogram"] or {}).items():
            self.histogram[index] = self.histogram.get(index, 0) + count
        add_to_histogram(self.prediction_histogram, row["prediction_error_histogram"] or {})
        parts = _breakdown(row)
        if parts is not None:
            self.bucket_means.append((row["ttft_count"], parts))

    def quantile_ms(self, q: float) -> float | None:
        return histogram_quantile_ms(self.histogram, q)

    def summary(self) -> dict[str, Any]:
        """Counts, TTFT percentiles, the mean breakdown and the median bucket's breakdown.

        In ``mean`` and ``p50`` the parts add up to their own ``ttft`` (the same statistic):
        ``mean`` is every request's mean, ``p50`` the median bucket (by its mean TTFT, weighted by
        requests) with that bucket's parts. ``ttft_p50_ms`` is the measured median, a different
        figure, shown apart.
        """
        return {
            "count": self.count,
            "errors": self.errors,
            "client_errors": self.client_errors,
            "ttft_p50_ms": self.quantile_ms(0.5),
            "ttft_p99_ms": self.quantile_ms(0.99),
            "ttft_mean_ms": (
                round(self.sums["ttft_sum_ms"] / self.sums["ttft_count"], 3)
                if self.sums["ttft_count"]
                else None
            ),
            "mean": _breakdown(self.sums),
            "p50": _median_bucket_parts(self.bucket_means),
            "prompt_tokens": self.sums["prompt_tokens"],
            "cached_tokens": self.sums["cached_tokens"],
            "predicted_cached_tokens": self.sums["predicted_cached_tokens"],
            "prediction": self.prediction(),
        }

    def prediction(self) -> dict[str, Any] | None:
        """The cost model's predicted TTFT against the measured one over these buckets."""
        quality = prediction_quality(
            self.sums["prediction_count"],
            self.sums["prediction_error_sum_ms"],
            self.sums["prediction_abs_error_sum_ms"],
            self.prediction_histogram,
        )
        return msgspec.to_builtins(quality) if quality is not None else None


def _breakdown(sums: dict[str, Any]) -> dict[str, float] | None:
    """Telemetry's breakdown (parts add up to the mean TTFT, remainder in "other")."""
    row = RequestAggregate(**{name: sums[name] or 0 for name in SUMMED_FIELDS})
    parts = breakdown_of(row)
    if parts is None:
        return None
    return {name: getattr(parts, f"{name}_ms") for name in COMPONENTS} | {"ttft": parts.ttft_mean_ms}


def _median_bucket_parts(bucket_means: list[tuple[int, dict[str, float]]]) -> dict[str, float] | None:
    """The parts of the median bucket: the bucket whose mean TTFT is the weighted median.

    One bucket's parts, so they add up to its TTFT. (Taking each part's own median over buckets,
    as this did before, stacked to about twice the TTFT drawn beside it: the medians of parts are
    not parts of the median.)
    """
    if not bucket_means:
        return None
    total = sum(weight for weight, _ in bucket_means)
    seen = 0
    for weight, parts in sorted(bucket_means, key=lambda item: item[1]["ttft"]):
        seen += weight
        if seen * 2 >= total:
            return {name: round(value, 3) for name, value in parts.items()}
    return None


def _dt(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=UTC)


_BUCKET_FIELDS = (
    "scope",
    "node_id",
    "region__slug",
    "bucket_start",
    "ttft_histogram",
    "prediction_error_histogram",
    "ttft_p50_ms",
    "ttft_p99_ms",
    *SUMMED_FIELDS,
)


def _buckets(
    resolution: str, since_s: float, until_s: float, scope: str | None = None
) -> Iterable[dict[str, Any]]:
    rows = RequestAggregate.objects.filter(
        resolution=resolution, bucket_start__gte=_dt(since_s), bucket_start__lt=_dt(until_s)
    )
    if scope is not None:
        rows = rows.filter(scope=scope)
    return rows.order_by("bucket_start").values(*_BUCKET_FIELDS).iterator(chunk_size=2000)


def _key(row: dict[str, Any]) -> str:
    return str(row["node_id"]) if row["scope"] == ScopeChoices.NODE else row["region__slug"]


def overview(now_s: float | None = None) -> dict[str, Any]:
    """Headline (last complete minute), per-region figures for the map, and 15 min of 10 s series."""
    now_s = time.time() if now_s is None else now_s
    # The bucket in progress is partial: the headline covers the last six complete 10 s buckets.
    until_s = (now_s // 10) * 10
    since_s = until_s - HEADLINE_WINDOW_S
    fleet, per_region = Merged(), defaultdict(Merged)
    series: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in _buckets("10s", until_s - 15 * 60, until_s + 10, ScopeChoices.REGION):
        start_s = row["bucket_start"].timestamp()
        series[row["region__slug"]].append(
            {
                "t": start_s,
                "count": row["count"],
                "errors": row["errors"],
                "ttft_p50_ms": row["ttft_p50_ms"],
                "ttft_p99_ms": row["ttft_p99_ms"],
            }
        )
        if since_s <= start_s < until_s:
            fleet.add(row)
            per_region[row["region__slug"]].add(row)
    hits = queries = 0.0
    for hit_tokens, query_tokens in MetricSample.objects.filter(
        ok=True, ts__gte=_dt(now_s - HEADLINE_WINDOW_S), prefix_queries_tokens__isnull=False
    ).values_list("prefix_hits_tokens", "prefix_queries_tokens"):
        hits += hit_tokens or 0.0
        queries += query_tokens or 0.0
    return {
        "now": now_s,
        "headline": {
            "window_s": HEADLINE_WINDOW_S,
            "ttft_p50_ms": fleet.quantile_ms(0.5),
            "ttft_p99_ms": fleet.quantile_ms(0.99),
            "rate_rps": fleet.count / HEADLINE_WINDOW_S,
            # The fleet's failures (5xx, no answer) apart from the clients' own mistakes (4xx).
            "error_rate": fleet.errors / fleet.count if fleet.count else None,
            "client_error_rate": fleet.client_errors / fleet.count if fleet.count else None,
            "hit_rate": hits / queries if queries else None,
        },
        "regions": {
            slug: {
                "rate_rps": m.count / HEADLINE_WINDOW_S,
                "ttft_p50_ms": m.quantile_ms(0.5),
                "count": m.count,
            }
            for slug, m in per_region.items()
        },
        "series": series,
    }


def breakdown(window: Window, now_s: float | None = None) -> dict[str, Any]:
    """Per region and per node: TTFT percentiles and its parts over the window; TTFT per step."""
    now_s = time.time() if now_s is None else now_s
    since_s = now_s - window.seconds
    totals: dict[str, dict[str, Merged]] = {scope: defaultdict(Merged) for scope in ScopeChoices.values}
    steps: dict[str, dict[float, Merged]] = defaultdict(lambda: defaultdict(Merged))
    for row in _buckets(window.resolution, since_s, now_s + window.step_s):
        key = _key(row)
        totals[row["scope"]][key].add(row)
        if row["scope"] == ScopeChoices.REGION:
            step_start = (row["bucket_start"].timestamp() // window.step_s) * window.step_s
            steps[key][step_start].add(row)
    return {
        "now": now_s,
        "window": window.key,
        "step_s": window.step_s,
        "regions": {key: merged.summary() for key, merged in totals["region"].items()},
        "nodes": {key: merged.summary() for key, merged in totals["node"].items()},
        # Regions whose requests were served both in the region and from elsewhere, split.
        "split": {
            key: {"local": local.summary(), "cross": totals["cross"][key].summary()}
            for key, local in totals["local"].items()
            if local.sums["ttft_count"] and totals["cross"][key].sums["ttft_count"]
        },
        "series": {
            key: [
                {
                    "t": t,
                    "count": m.count,
                    "ttft_p50_ms": m.quantile_ms(0.5),
                    "ttft_p99_ms": m.quantile_ms(0.99),
                }
                for t, m in sorted(by_step.items())
            ]
            for key, by_step in steps.items()
        },
    }


def cache(window: Window, now_s: float | None = None) -> dict[str, Any]:
    """Per node: prefix-cache hit rate and KV usage per step (scrapes), and routed vs hit tokens."""
    now_s = time.time() if now_s is None else now_s
    since_s = now_s - window.seconds
    # Scrapes come every few seconds: merge them into at most MAX_POINTS steps per node.
    step_s = max(5, -(-window.seconds // MAX_POINTS))
    acc: dict[int, dict[float, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0, 0.0, 0]))
    rows = (
        MetricSample.objects.filter(ok=True, ts__gte=_dt(since_s))
        .order_by("ts")
        .values_list("node_id", "ts", "prefix_hits_tokens", "prefix_queries_tokens", "kv_cache_usage")
        .iterator(chunk_size=5000)
    )
    counters: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])  # node -> hits, queries
    for node_id, ts, hits, queries, kv in rows:
        cell = acc[node_id][(ts.timestamp() // step_s) * step_s]
        if queries:
            cell[0] += hits or 0.0
            cell[1] += queries
            counters[node_id][0] += hits or 0.0
            counters[node_id][1] += queries
        if kv is not None:
            cell[2] += kv
            cell[3] += 1
    series = {
        str(node_id): [
            {
                "t": t,
                "hit_rate": round(c[0] / c[1], 4) if c[1] else None,
                "kv_cache_usage": round(c[2] / c[3], 4) if c[3] else None,
            }
            for t, c in sorted(by_step.items())
        ]
        for node_id, by_step in acc.items()
    }
    routed: dict[str, Merged] = defaultdict(Merged)
    for row in _buckets(window.resolution, since_s, now_s + 60, ScopeChoices.NODE):
        routed[str(row["node_id"])].add(row)
    return {
        "now": now_s,
        "window": window.key,
        "step_s": step_s,
        "series": series,
        "routed": {key: _routed(m, counters.get(int(key))) for key, m in routed.items()},
    }


def _routed(merged: Merged, counters: list[float] | None) -> dict[str, Any]:
    """A node's routed vs hit tokens. Requests whose node reported no ``cached_tokens`` (vLLM
    without --enable-prompt-tokens-details) are not 0 % hits: their share is estimated from the
    node's own prefix-cache counters over the window (``/metrics``), and ``cached_source`` says
    which: "usage", "metrics", "usage+metrics", or None when neither is known."""
    sums = merged.sums
    prompt = sums["prompt_tokens"]
    reported = min(sums["cached_reported_prompt_tokens"], prompt)
    cached: float | None = sums["cached_tokens"] if reported else None
    source = "usage" if reported else None
    unreported = prompt - reported
    if unreported > 0:
        if counters is not None and counters[1]:
            cached = (cached or 0) + round(unreported * counters[0] / counters[1])
            source = "usage+metrics" if reported else "metrics"
        elif not reported:
            cached = None
    return {
        "prompt_tokens": prompt,
        "predicted_cached_tokens": sums["predicted_cached_tokens"],
        "cached_tokens": cached,
        "cached_source": source,
        "count": merged.count,
    }


# ---------------------------------------------------------------------------------------------
# Client-key usage
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class KeyUsage:
    """Key-usage buckets added together: telemetry's sums (``KEY_USAGE_SUMMED_FIELDS``) and the TTFT histogram."""

    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KEY_USAGE_SUMMED_FIELDS, 0))
    histogram: dict[str, int] = field(default_factory=dict)

    def add(self, row: dict[str, Any]) -> None:
        for name in KEY_USAGE_SUMMED_FIELDS:
            self.sums[name] += row[name] or 0
        add_to_histogram(self.histogram, row["ttft_histogram"] or {})

    def summary(self) -> dict[str, Any]:
        sums = self.sums
        count = int(sums["count"])
        errors = int(sums["errors_4xx"] + sums["errors_5xx"])
        return {
            **{name: int(sums[name]) for name in KEY_USAGE_SUMMED_FIELDS if name != "ttft_sum_ms"},
            "errors": errors,
            "error_rate": round(errors / count, 4) if count else None,
            "ttft_mean_ms": round(sums["ttft_sum_ms"] / sums["ttft_count"], 3)
            if sums["ttft_count"]
            else None,
            "ttft_p50_ms": histogram_quantile_ms(self.histogram, 0.5),
            "ttft_p99_ms": histogram_quantile_ms(self.histogram, 0.99),
        }


def key_usage(window: Window, now_s: float | None = None) -> dict[str, Any]:
    """Per client key and per team over the window: requests, errors (4xx/5xx), limited/refused,
    tokens, TTFT p50/p99; and per team, requests and tokens per step. Two queries, whatever the
    number of keys (the buckets, the keys' names). Keys are named by their public id, never a secret."""
    now_s = time.time() if now_s is None else now_s
    since_s = now_s - window.seconds
    per_key: dict[str, KeyUsage] = defaultdict(KeyUsage)
    per_team: dict[str, KeyUsage] = defaultdict(KeyUsage)
    key_info: dict[str, dict[str, Any]] = {}
    team_keys: dict[str, set[str]] = defaultdict(set)
    steps: dict[str, dict[float, KeyUsage]] = defaultdict(lambda: defaultdict(KeyUsage))
    rows = (
        KeyUsageAggregate.objects.filter(
            resolution=window.resolution,
            bucket_start__gte=_dt(since_s),
            bucket_start__lt=_dt(now_s + window.step_s),
        )
        .order_by("bucket_start")
        .values("key_id", "team", "priority", "bucket_start", "ttft_histogram", *KEY_USAGE_SUMMED_FIELDS)
        .iterator(chunk_size=2000)
    )
    for row in rows:
        key_id, team = row["key_id"], row["team"]
        per_key[key_id].add(row)
        per_team[team].add(row)
        team_keys[team].add(key_id)
        info = key_info.setdefault(key_id, {"team": team, "priorities": set()})
        info["team"] = team  # the latest bucket's team (rows come oldest first)
        if row["priority"]:
            info["priorities"].add(row["priority"])
        step_start = (row["bucket_start"].timestamp() // window.step_s) * window.step_s
        steps[team][step_start].add(row)
    names = dict(ClientKey.objects.filter(key_id__in=list(per_key)).values_list("key_id", "name"))
    keys = [
        {
            "key_id": key_id,
            "name": names.get(key_id),  # None: the key was deleted
            "team": key_info[key_id]["team"],
            "priorities": sorted(key_info[key_id]["priorities"]),
            **usage.summary(),
        }
        for key_id, usage in per_key.items()
    ]
    teams = [
        {"team": team, "keys": len(team_keys[team]), **usage.summary()} for team, usage in per_team.items()
    ]
    return {
        "now": now_s,
        "window": window.key,
        "step_s": window.step_s,
        "keys": sorted(keys, key=lambda item: (-item["count"], item["name"] or "", item["key_id"])),
        "teams": sorted(teams, key=lambda item: (-item["count"], item["team"])),
        "series": {
            team: [
                {
                    "t": t,
                    "count": int(u.sums["count"]),
                    "errors": int(u.sums["errors_4xx"] + u.sums["errors_5xx"]),
                    "tokens": int(u.sums["prompt_tokens"] + u.sums["completion_tokens"]),
                }
                for t, u in sorted(by_step.items())
            ]
            for team, by_step in steps.items()
        },
    }
