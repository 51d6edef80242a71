"""Chart data: buckets merged into windows, percentiles from merged histograms, partial buckets left out."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from django.test import Client

from controlplane.dashboard import series
from telemetry.aggregation import histogram_quantile_ms, ttft_bin
from telemetry.models import MetricSample, RequestAggregate
from tests.dashboard.conftest import Fleet

NOW_S = 1_800_000_000.0  # a bucket boundary: divisible by 60


def dt(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=UTC)


def bucket(
    fleet: Fleet,
    start_s: float,
    ttfts_ms: list[float],
    *,
    region: str | None = None,
    node: str | None = None,
    resolution: str = "10s",
    errors: int = 0,
    client_errors: int = 0,
    scope: str | None = None,
    parts_ms=(1.0, 50.0, 20.0, 100.0),
    prompt_tokens: int = 0,
    cached_tokens: int = 0,
    cached_reported_prompt_tokens: int | None = None,
) -> RequestAggregate:
    """A bucket as telemetry writes it: sums, and the log-bucketed histogram of the TTFTs."""
    histogram: dict[str, int] = {}
    for ttft in ttfts_ms:
        histogram[str(ttft_bin(ttft))] = histogram.get(str(ttft_bin(ttft)), 0) + 1
    n = len(ttfts_ms)
    gateway, network, queue, prefill = parts_ms
    return RequestAggregate.objects.create(
        resolution=resolution,
        scope=scope or ("region" if region else "node"),
        region=fleet.regions[region] if region else None,
        node=fleet.nodes[node] if node else None,
        bucket_start=dt(start_s),
        count=n,
        errors=errors,
        client_errors=client_errors,
        ttft_count=n,
        ttft_sum_ms=sum(ttfts_ms),
        ttft_histogram=histogram,
        ttft_p50_ms=histogram_quantile_ms(histogram, 0.5),
        ttft_p99_ms=histogram_quantile_ms(histogram, 0.99),
        gateway_sum_ms=gateway * n,
        network_sum_ms=network * n,
        network_count=n,
        queue_sum_ms=queue * n,
        prefill_sum_ms=prefill * n,
        node_stats_count=n,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        cached_reported_prompt_tokens=(
            prompt_tokens if cached_reported_prompt_tokens is None else cached_reported_prompt_tokens
        ),
    )


@pytest.mark.django_db
def test_it_merges_the_last_complete_minute_into_the_headline(fleet: Fleet) -> None:
    # Six complete 10 s buckets in the last minute (100 ms each), and the bucket in progress
    # (10 s ms TTFTs) that must not count yet.
    for k in range(1, 7):
        bucket(fleet, NOW_S - 10 * k, [100.0] * 10, region="us-east", errors=1 if k == 1 else 0)
    bucket(fleet, NOW_S, [10_000.0] * 50, region="us-east")
    bucket(fleet, NOW_S - 70, [900.0] * 10, region="eu-central")  # older than a minute

    data = series.overview(now_s=NOW_S + 5)

    headline = data["headline"]
    assert headline["rate_rps"] == 1.0  # 60 requests / 60 s
    assert headline["error_rate"] == pytest.approx(1 / 60)
    assert headline["ttft_p50_ms"] == pytest.approx(100.0, rel=0.03)
    assert headline["ttft_p99_ms"] == pytest.approx(100.0, rel=0.03)
    assert set(data["regions"]) == {"us-east"}
    assert len(data["series"]["us-east"]) == 7  # the partial bucket is still drawn
    assert data["series"]["us-east"][-1]["ttft_p50_ms"] == pytest.approx(10_000.0, rel=0.03)
    assert {p["t"] for p in data["series"]["eu-central"]} == {NOW_S - 70}


@pytest.mark.django_db
def test_it_reports_the_fleet_hit_rate_from_the_scraped_token_counters(fleet: Fleet) -> None:
    for name, hits, queries in (("us-east-1", 90.0, 100.0), ("eu-central-1", 10.0, 100.0)):
        MetricSample.objects.create(
            node=fleet.nodes[name],
            ts=dt(NOW_S - 5),
            ok=True,
            prefix_hits_tokens=hits,
            prefix_queries_tokens=queries,
        )
    assert series.overview(now_s=NOW_S)["headline"]["hit_rate"] == pytest.approx(0.5)


@pytest.mark.django_db
def test_it_breaks_ttft_down_per_region_and_node_over_the_window(fleet: Fleet) -> None:
    window = series.Window.of("15m", 15 * 60, "10s")
    bucket(fleet, NOW_S - 60, [200.0] * 4, region="ap-south", parts_ms=(1.0, 120.0, 10.0, 60.0))
    bucket(fleet, NOW_S - 50, [400.0] * 4, region="ap-south", parts_ms=(1.0, 240.0, 30.0, 120.0))
    bucket(fleet, NOW_S - 50, [400.0] * 8, node="ap-south-1", parts_ms=(1.0, 240.0, 30.0, 120.0))
    bucket(fleet, NOW_S - 3600, [5000.0], region="ap-south")  # outside the window

    data = series.breakdown(window, now_s=NOW_S)

    region = data["regions"]["ap-south"]
    assert region["count"] == 8
    mean = region["mean"]
    assert mean["ttft"] == pytest.approx(300.0)
    assert (mean["gateway"], mean["network"], mean["queue"], mean["prefill"]) == pytest.approx(
        (1.0, 180.0, 20.0, 90.0)
    )
    assert sum(mean[c] for c in series.COMPONENTS) == pytest.approx(mean["ttft"])  # parts add up
    assert region["p50"]["network"] in (120.0, 240.0)  # a real bucket's value, not an average
    assert region["ttft_p50_ms"] == pytest.approx(200.0, rel=0.03)
    assert data["nodes"][str(fleet.nodes["ap-south-1"].pk)]["count"] == 8
    assert [p["count"] for p in data["series"]["ap-south"]] == [4, 4]


@pytest.mark.django_db
def test_the_p50_parts_add_up_to_the_ttft_drawn_beside_them(fleet: Fleet) -> None:
    # The repro: per-part medians over buckets stacked to ~2x the TTFT beside them. Bucket A is
    # network-heavy, B prefill-heavy, C queue-heavy; each part's own median is a big number.
    window = series.Window.of("15m", 15 * 60, "10s")
    bucket(fleet, NOW_S - 60, [40.0] * 4, region="ap-south", parts_ms=(1.0, 36.0, 1.0, 2.0))
    bucket(fleet, NOW_S - 50, [19.0] * 4, region="ap-south", parts_ms=(1.0, 2.0, 1.0, 15.0))
    bucket(fleet, NOW_S - 40, [45.0] * 4, region="ap-south", parts_ms=(1.0, 30.0, 2.0, 12.0))

    region = series.breakdown(window, now_s=NOW_S)["regions"]["ap-south"]

    for stat in ("mean", "p50"):
        parts = region[stat]
        assert sum(parts[c] for c in series.COMPONENTS) == pytest.approx(parts["ttft"]), stat
    assert region["p50"]["ttft"] == 40.0  # the median bucket, whole: network 36 of its 40 ms
    assert region["p50"]["network"] == 36.0


@pytest.mark.django_db
def test_it_splits_a_region_served_both_locally_and_from_elsewhere(fleet: Fleet) -> None:
    window = series.Window.of("15m", 15 * 60, "10s")
    bucket(fleet, NOW_S - 60, [20.0] * 6 + [260.0] * 2, region="ap-south", parts_ms=(1.0, 60.0, 4.0, 10.0))
    bucket(fleet, NOW_S - 60, [20.0] * 6, region="ap-south", scope="local", parts_ms=(1.0, 1.0, 4.0, 10.0))
    bucket(fleet, NOW_S - 60, [260.0] * 2, region="ap-south", scope="cross", parts_ms=(1.0, 235.0, 4.0, 10.0))
    bucket(fleet, NOW_S - 60, [20.0] * 3, region="us-east", scope="local")  # local only: not split

    data = series.breakdown(window, now_s=NOW_S)

    assert set(data["split"]) == {"ap-south"}
    local, cross = data["split"]["ap-south"]["local"], data["split"]["ap-south"]["cross"]
    assert (local["count"], cross["count"]) == (6, 2)
    assert (local["mean"]["network"], cross["mean"]["network"]) == (1.0, 235.0)
    for summary in (local, cross):
        assert sum(summary["mean"][c] for c in series.COMPONENTS) == pytest.approx(summary["mean"]["ttft"])
    assert data["regions"]["ap-south"]["count"] == 8  # the region's own bar is unchanged


@pytest.mark.django_db
def test_the_error_rate_counts_the_fleets_failures_not_the_clients_4xx(fleet: Fleet) -> None:
    for k in range(1, 7):
        bucket(
            fleet, NOW_S - 10 * k, [100.0] * 10, region="us-east", errors=1 if k == 1 else 0, client_errors=5
        )

    headline = series.overview(now_s=NOW_S + 5)["headline"]

    assert headline["error_rate"] == pytest.approx(1 / 60)
    assert headline["client_error_rate"] == pytest.approx(30 / 60)


@pytest.mark.django_db
def test_it_merges_a_day_into_at_most_180_points(fleet: Fleet) -> None:
    window = series.Window.of("24h", 24 * 3600, "1m")
    assert window.step_s == 480
    for minute in range(0, 24 * 60, 7):
        bucket(fleet, NOW_S - 24 * 3600 + minute * 60, [150.0], region="us-east", resolution="1m")
    data = series.breakdown(window, now_s=NOW_S)
    assert len(data["series"]["us-east"]) <= 180
    assert sum(p["count"] for p in data["series"]["us-east"]) == data["regions"]["us-east"]["count"]


@pytest.mark.django_db
def test_it_gives_per_node_cache_series_and_routed_vs_hit(fleet: Fleet) -> None:
    node = fleet.nodes["eu-central-1"]
    for k, (hits, queries, kv) in enumerate(((50.0, 100.0, 0.2), (100.0, 100.0, 0.4))):
        MetricSample.objects.create(
            node=node,
            ts=dt(NOW_S - 100 + 5 * k),
            ok=True,
            prefix_hits_tokens=hits,
            prefix_queries_tokens=queries,
            kv_cache_usage=kv,
        )
    bucket(fleet, NOW_S - 60, [100.0] * 3, node="eu-central-1", prompt_tokens=3000, cached_tokens=2400)

    data = series.cache(series.Window.of("15m", 15 * 60, "10s"), now_s=NOW_S)

    points = data["series"][str(node.pk)]
    assert [(p["hit_rate"], p["kv_cache_usage"]) for p in points] == [(0.5, 0.2), (1.0, 0.4)]
    assert data["routed"][str(node.pk)] == {
        "prompt_tokens": 3000,
        "predicted_cached_tokens": 0,
        "cached_tokens": 2400,
        "cached_source": "usage",
        "count": 3,
    }


@pytest.mark.django_db
def test_unreported_cached_tokens_come_from_the_nodes_prefix_cache_counters(fleet: Fleet) -> None:
    # vLLM without --enable-prompt-tokens-details: no cached_tokens in usage. Its own counters
    # said 60 % over the window: that, not 0 %, is the node's hit share.
    node = fleet.nodes["eu-central-1"]
    MetricSample.objects.create(
        node=node, ts=dt(NOW_S - 100), ok=True, prefix_hits_tokens=60.0, prefix_queries_tokens=100.0
    )
    bucket(
        fleet,
        NOW_S - 60,
        [100.0] * 3,
        node="eu-central-1",
        prompt_tokens=3000,
        cached_reported_prompt_tokens=0,
    )
    bucket(fleet, NOW_S - 60, [100.0], node="us-east-1", prompt_tokens=500, cached_reported_prompt_tokens=0)

    data = series.cache(series.Window.of("15m", 15 * 60, "10s"), now_s=NOW_S)

    routed = data["routed"][str(node.pk)]
    assert (routed["cached_tokens"], routed["cached_source"]) == (1800, "metrics")
    unknown = data["routed"][str(fleet.nodes["us-east-1"].pk)]
    assert (unknown["cached_tokens"], unknown["cached_source"]) == (None, None)  # not reported, not 0


@pytest.mark.django_db
def test_it_rejects_an_unknown_window(viewer_client: Client) -> None:
    response = viewer_client.get("/data/breakdown/?window=7d")
    assert response.status_code == 400
    assert response.json() == {"window": "Unknown window 7d; use one of 15m, 1h, 24h."}


@pytest.mark.django_db
@pytest.mark.parametrize("url", ["/data/overview/", "/data/breakdown/?window=1h", "/data/cache/?window=24h"])
def test_it_serves_chart_data_to_signed_in_users(viewer_client: Client, fleet: Fleet, url: str) -> None:
    response = viewer_client.get(url)
    assert response.status_code == 200
    assert response["Cache-Control"] == "no-store"
    assert "now" in response.json()
