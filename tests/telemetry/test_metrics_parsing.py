"""vLLM /metrics parsing: current and older names, several engines, resets, histograms, garbage."""

from __future__ import annotations

import msgspec
import pytest

from telemetry.vllm_metrics import MetricsParseError, interval_between, parse_metrics
from tests.support.vllm_stub import FIXTURE_METRICS, FIXTURES, metrics_text

OLD_FIXTURE = (FIXTURES / "vllm_metrics_v0_10.txt").read_text()


def scaled(text: str, **replacements: str) -> str:
    for old, new in replacements.items():
        text = text.replace(old, new)
    return text


class TestSharedFixture:
    def test_it_reads_the_gauges_and_counters(self):
        scrape = parse_metrics(FIXTURE_METRICS, scraped_at=100.0)

        assert scrape.gauges == {"num_running": 4.0, "num_waiting": 2.0, "kv_cache_usage": 0.0625}
        assert sum(scrape.counters["prefix_queries"].values()) == 10752.0
        assert sum(scrape.counters["prefix_hits"].values()) == 6144.0
        assert sum(scrape.counters["requests_finished"].values()) == 20.0  # all finished_reason series
        assert scrape.sources["kv_cache_usage"] == "vllm:kv_cache_usage_perc"
        assert scrape.sources["prefix_hits"] == "vllm:prefix_cache_hits_total"

    def test_it_has_no_interval_on_the_first_scrape(self):
        interval = interval_between(None, parse_metrics(FIXTURE_METRICS, scraped_at=100.0))

        assert interval.interval_s is None
        assert interval.prefix_hit_rate is None
        assert interval.gauge("num_running") == 4.0

    def test_it_turns_the_ttft_histogram_into_quantiles_and_a_mean(self):
        current = parse_metrics(FIXTURE_METRICS, scraped_at=100.0)
        # A baseline with empty buckets: the interval holds exactly the fixture's 20 observations.
        empty = {
            series: msgspec.structs.replace(h, cumulative=(0.0,) * len(h.bounds), count=0.0, sum=0.0)
            for series, h in current.histograms["ttft"].items()
        }
        baseline = msgspec.structs.replace(current, scraped_at=90.0, histograms={"ttft": empty})

        interval = interval_between(baseline, current)

        ttft = interval.histograms["ttft"]
        assert ttft.count == 20
        assert ttft.mean_ms == pytest.approx(132.35)
        assert ttft.quantile_ms(0.5) == pytest.approx(60.0)  # rank 10 = top of the 40-60 ms bucket
        assert ttft.quantile_ms(0.9) == pytest.approx(250 + 250 * 2 / 3)  # rank 18 inside 250-500 ms
        assert interval.mean_ms("queue") is None  # not in the fixture: missing, not zero

    def test_it_computes_the_hit_rate_over_the_interval_in_tokens(self):
        before = parse_metrics(FIXTURE_METRICS, scraped_at=100.0)
        after = parse_metrics(
            scaled(FIXTURE_METRICS, **{"} 10752.0": "} 20752.0", "} 6144.0": "} 15144.0"}), scraped_at=105.0
        )

        interval = interval_between(before, after)

        assert interval.interval_s == 5.0
        assert interval.deltas["prefix_queries"] == 10000.0
        assert interval.deltas["prefix_hits"] == 9000.0
        assert interval.prefix_hit_rate == pytest.approx(0.9)  # not the cumulative 15144/20752
        assert interval.rate_per_s("prompt_tokens") == pytest.approx(2000.0)
        assert interval.counters_reset is False


class TestOlderNames:
    def test_it_reads_the_older_names(self):
        scrape = parse_metrics(OLD_FIXTURE, scraped_at=100.0)

        assert scrape.gauges["kv_cache_usage"] == 0.0625
        assert scrape.sources["kv_cache_usage"] == "vllm:gpu_cache_usage_perc"
        assert scrape.sources["prefix_queries"] == "vllm:gpu_prefix_cache_queries_total"
        assert scrape.sources["prefix_hits"] == "vllm:gpu_prefix_cache_hits_total"
        assert scrape.sources["itl"] == "vllm:time_per_output_token_seconds"
        assert sum(scrape.counters["prefix_hits"].values()) == 6144.0

    def test_it_computes_the_hit_rate_from_older_names(self):
        before = parse_metrics(metrics_text(engines={"0": {"queries": 100, "hits": 10}}, old_names=True), 1.0)
        after = parse_metrics(metrics_text(engines={"0": {"queries": 300, "hits": 160}}, old_names=True), 2.0)

        assert interval_between(before, after).prefix_hit_rate == pytest.approx(0.75)

    def test_it_prefers_the_current_name_when_a_page_has_both(self):
        page = metrics_text(engines={"0": {"kv": 0.5}}) + metrics_text(
            engines={"0": {"kv": 0.9}}, old_names=True
        )

        scrape = parse_metrics(page, 1.0)

        assert scrape.gauges["kv_cache_usage"] == 0.5
        assert scrape.sources["kv_cache_usage"] == "vllm:kv_cache_usage_perc"


class TestSeveralEngines:
    def test_it_sums_counts_and_averages_the_kv_fraction(self):
        page = metrics_text(
            engines={
                "0": {"running": 3, "waiting": 1, "kv": 0.2, "queries": 100, "hits": 50},
                "1": {"running": 5, "waiting": 4, "kv": 0.6, "queries": 300, "hits": 30},
            }
        )

        scrape = parse_metrics(page, 1.0)

        assert scrape.gauges["num_running"] == 8
        assert scrape.gauges["num_waiting"] == 5
        assert scrape.gauges["kv_cache_usage"] == pytest.approx(0.4)  # each engine has its own KV cache
        assert len(scrape.counters["prefix_queries"]) == 2

    def test_it_sums_per_engine_deltas_and_merges_histograms(self):
        buckets_before = {
            "0": [("0.1", 1), ("1.0", 2), ("+Inf", 2)],
            "1": [("0.1", 0), ("1.0", 1), ("+Inf", 1)],
        }
        buckets_after = {
            "0": [("0.1", 5), ("1.0", 6), ("+Inf", 6)],
            "1": [("0.1", 0), ("1.0", 5), ("+Inf", 5)],
        }
        before = parse_metrics(
            metrics_text(
                engines={"0": {"queries": 100, "hits": 50}, "1": {"queries": 100, "hits": 0}},
                ttft_buckets=buckets_before,
            ),
            1.0,
        )
        after = parse_metrics(
            metrics_text(
                engines={"0": {"queries": 200, "hits": 150}, "1": {"queries": 300, "hits": 0}},
                ttft_buckets=buckets_after,
            ),
            3.0,
        )

        interval = interval_between(before, after)

        assert interval.deltas["prefix_queries"] == 300
        assert interval.deltas["prefix_hits"] == 100
        ttft = interval.histograms["ttft"]
        assert ttft.count == 8  # 4 new on engine 0, 4 on engine 1
        assert ttft.cumulative == (4.0, 8.0)  # engine 0's 4 fast ones, then engine 1's 4 slower ones
        assert ttft.quantile_ms(0.5) == pytest.approx(100.0)


class TestCounterResets:
    def test_it_treats_a_counter_that_went_back_as_restarted_from_zero(self):
        before = parse_metrics(
            metrics_text(engines={"0": {"queries": 5000, "hits": 4000, "prompt": 5000}}), 1.0
        )
        after = parse_metrics(metrics_text(engines={"0": {"queries": 200, "hits": 50, "prompt": 200}}), 6.0)

        interval = interval_between(before, after)

        assert interval.counters_reset is True
        assert interval.deltas["prefix_queries"] == 200  # not -4800
        assert interval.prefix_hit_rate == pytest.approx(0.25)
        assert interval.rate_per_s("prompt_tokens") == pytest.approx(40.0)

    def test_it_resets_only_the_engine_that_restarted(self):
        before = parse_metrics(
            metrics_text(engines={"0": {"queries": 1000, "hits": 0}, "1": {"queries": 1000, "hits": 0}}), 1.0
        )
        after = parse_metrics(
            metrics_text(engines={"0": {"queries": 1500, "hits": 0}, "1": {"queries": 300, "hits": 0}}), 2.0
        )

        interval = interval_between(before, after)

        assert interval.deltas["prefix_queries"] == 500 + 300

    def test_it_notices_a_restart_by_the_created_timestamp(self):
        # The restarted node has already counted past the old value: only _created tells.
        before = parse_metrics(metrics_text(engines={"0": {"queries": 100, "hits": 0}}, created=1000.0), 1.0)
        after = parse_metrics(metrics_text(engines={"0": {"queries": 400, "hits": 0}}, created=2000.0), 2.0)

        interval = interval_between(before, after)

        assert interval.counters_reset is True
        assert interval.deltas["prefix_queries"] == 400

    def test_it_restarts_a_histogram_that_went_back(self):
        before = parse_metrics(
            metrics_text(engines={"0": {}}, ttft_buckets={"0": [("0.1", 50), ("1.0", 90), ("+Inf", 100)]}),
            1.0,
        )
        after = parse_metrics(
            metrics_text(engines={"0": {}}, ttft_buckets={"0": [("0.1", 3), ("1.0", 4), ("+Inf", 4)]}), 2.0
        )

        interval = interval_between(before, after)

        assert interval.counters_reset is True
        assert interval.histograms["ttft"].count == 4


class TestMissingAndGarbage:
    def test_it_leaves_missing_metrics_out(self):
        scrape = parse_metrics("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 2\n", 1.0)

        assert scrape.gauges == {"num_running": 2.0}
        assert scrape.counters == {}
        assert scrape.histograms == {}

    def test_it_reports_a_quantile_in_the_inf_bucket_as_the_highest_finite_bound(self):
        before = parse_metrics(
            metrics_text(engines={"0": {}}, ttft_buckets={"0": [("0.5", 0), ("+Inf", 0)]}), 1.0
        )
        after = parse_metrics(
            metrics_text(engines={"0": {}}, ttft_buckets={"0": [("0.5", 1), ("+Inf", 10)]}), 2.0
        )

        assert interval_between(before, after).histograms["ttft"].quantile_ms(0.99) == 500.0

    @pytest.mark.parametrize(
        ("page", "message"),
        [
            ("<html><body>502 Bad Gateway</body></html>", "not Prometheus text format"),
            ("vllm:num_requests_running{engine=0 3\n", "not Prometheus text format"),
            ("vllm:num_requests_running lots\n", "not Prometheus text format"),
            ("", "no vLLM metrics"),
            ("# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 1.5\n", "no vLLM metrics"),
        ],
    )
    def test_it_rejects_garbage_with_a_clear_error(self, page, message):
        with pytest.raises(MetricsParseError, match=message):
            parse_metrics(page, 1.0)
