"""Scrape rounds: intervals stored, live state for the gateways, garbage marks the node scrape-failing."""

from __future__ import annotations

import time

import pytest

from routing import contract
from routing.contract import NodeLiveState
from simulator.harness import free_port
from telemetry import rounds
from telemetry.models import MetricSample, NodeHealth
from tests.support.vllm_stub import metrics_text
from tests.telemetry.conftest import make_node, make_regions

pytestmark = pytest.mark.django_db


class Counters:
    """A node's counters, advanced by the test between scrapes."""

    def __init__(self) -> None:
        self.values = {"running": 3, "waiting": 1, "kv": 0.25, "queries": 1000, "hits": 100, "prompt": 1000}
        self.queue = (0.0, 0)  # sum seconds, count

    def page(self) -> str:
        return metrics_text(engines={"0": self.values}, queue_sum_count={"0": self.queue})


def live(tel, node) -> NodeLiveState:
    return contract.decode(tel.client.hget(tel.keys.live_nodes, str(node.pk)), NodeLiveState)


def test_it_stores_the_interval_and_publishes_live_state(tel, http, stubs):
    counters = Counters()
    node = make_node("use-1", make_regions("us-east")["us-east"], stubs(metrics=counters.page).url)

    rounds.scrape_round(tel.client, tel.keys, http)
    counters.values.update(queries=3000, hits=1700, prompt=3000, running=5)
    counters.queue = (0.6, 20)  # 20 requests queued 30 ms on average
    result = rounds.scrape_round(tel.client, tel.keys, http)

    assert (result.scraped, result.failed) == (1, 0)
    first, second = MetricSample.objects.filter(node=node).order_by("ts")
    assert first.ok and first.prefix_hit_rate is None  # no baseline yet
    assert second.prefix_queries_tokens == 2000 and second.prefix_hits_tokens == 1600
    assert second.prefix_hit_rate == pytest.approx(0.8)
    assert second.queue_mean_ms == pytest.approx(30.0)
    assert second.num_running == 5
    state = live(tel, node)
    assert state.healthy is True
    assert (state.num_running, state.num_waiting, state.kv_cache_usage) == (5, 1, 0.25)
    assert state.prefix_hit_rate == pytest.approx(0.8)
    assert state.last_scrape_at is not None


def test_it_keeps_the_last_hit_rate_through_an_idle_interval(tel, http, stubs):
    counters = Counters()
    node = make_node("use-1", make_regions("us-east")["us-east"], stubs(metrics=counters.page).url)

    rounds.scrape_round(tel.client, tel.keys, http)
    counters.values.update(queries=2000, hits=600)
    rounds.scrape_round(tel.client, tel.keys, http)
    rounds.scrape_round(tel.client, tel.keys, http)  # nothing queried

    assert MetricSample.objects.filter(node=node).order_by("-ts").first().prefix_hit_rate is None
    assert live(tel, node).prefix_hit_rate == pytest.approx(0.5)


def test_garbage_marks_the_node_scrape_failing_without_stopping_the_round(tel, http, stubs):
    regions = make_regions("us-east")
    broken = make_node("use-1", regions["us-east"], stubs(metrics="<html>oops</html>").url)
    fine = make_node("use-2", regions["us-east"], stubs(metrics=Counters().page).url)

    result = rounds.scrape_round(tel.client, tel.keys, http)

    assert (result.scraped, result.failed) == (2, 1)
    sample = MetricSample.objects.get(node=broken)
    assert not sample.ok and "not Prometheus text format" in sample.error
    row = NodeHealth.objects.get(node=broken)
    assert row.scrape_failing and "unparseable /metrics" in row.scrape_error
    assert MetricSample.objects.get(node=fine).ok
    assert not NodeHealth.objects.get(node=fine).scrape_failing


def test_repeated_scrape_failures_make_the_node_unhealthy_and_recovery_clears_the_flag(tel, http, stubs):
    stub = stubs(metrics="garbage garbage")
    node = make_node("use-1", make_regions("us-east")["us-east"], stub.url)

    for _ in range(3):
        rounds.scrape_round(tel.client, tel.keys, http)

    assert NodeHealth.objects.get(node=node).health == "unhealthy"
    assert live(tel, node).healthy is False
    stub.metrics = Counters().page
    rounds.scrape_round(tel.client, tel.keys, http)
    rounds.scrape_round(tel.client, tel.keys, http)
    row = NodeHealth.objects.get(node=node)
    assert (row.health, row.scrape_failing, row.scrape_error) == ("healthy", False, "")
    assert live(tel, node).healthy is True


def test_an_unhealthy_node_is_marked_again_in_a_redis_that_lost_everything(tel, http, stubs):
    """Redis restarted empty (or failed over to an empty replica): a node telemetry knows is
    unhealthy and that keeps failing must get its mark back with the next round. Only transitions
    wrote ``healthy`` and a failed check wrote nothing, so the node stayed without a live entry,
    which the gateways route to as healthy, for as long as it stayed down."""
    node = make_node("use-1", make_regions("us-east")["us-east"], stubs(metrics="garbage garbage").url)
    for _ in range(3):
        rounds.scrape_round(tel.client, tel.keys, http)
    assert live(tel, node).healthy is False

    tel.client.delete(*tel.client.keys(f"{tel.keys.prefix}:*"))  # this test's namespace only
    rounds.scrape_round(tel.client, tel.keys, http)

    state = live(tel, node)
    assert state.healthy is False and state.updated_at >= time.time() - 60


def test_a_failing_unhealthy_nodes_mark_stays_fresh(tel, http, stubs):
    """The gateways drop a live entry older than GORGO_LIVE_STALE_S (30 s) and route to the node
    as unmeasured, so each round must refresh the entry of a node it found still failing."""
    node = make_node("use-1", make_regions("us-east")["us-east"], stubs(metrics="garbage garbage").url)
    for _ in range(3):
        rounds.scrape_round(tel.client, tel.keys, http)
    marked_at = live(tel, node).updated_at
    time.sleep(0.01)

    rounds.scrape_round(tel.client, tel.keys, http)

    state = live(tel, node)
    assert state.healthy is False and state.updated_at > marked_at


def test_an_unreachable_node_is_a_failed_scrape(tel, http):
    node = make_node("use-1", make_regions("us-east")["us-east"], f"http://127.0.0.1:{free_port()}")

    rounds.scrape_round(tel.client, tel.keys, http)

    assert "ConnectError" in MetricSample.objects.get(node=node).error
    assert NodeHealth.objects.get(node=node).scrape_failing


def test_disabled_nodes_are_not_scraped(tel, http, stubs):
    make_node("use-1", make_regions("us-east")["us-east"], stubs().url, state="disabled")

    assert rounds.scrape_round(tel.client, tel.keys, http).scraped == 0
    assert not MetricSample.objects.exists()


def test_a_node_trickling_its_metrics_does_not_hold_up_the_round(tel, http, stubs, settings):
    # Every byte arrives well within the read timeout, so only a deadline on the whole fetch ends
    # it; without one the round waits for the whole page (15 s or more here) and, under Celery, is
    # killed at its time limit with every other node's scrape lost.
    settings.GORGO_SCRAPE_TIMEOUT_S = 1.0
    regions = make_regions("us-east")
    slow = make_node("use-1", regions["us-east"], stubs(metrics_byte_delay_s=0.002).url)
    fine = make_node("use-2", regions["us-east"], stubs(metrics=Counters().page).url)

    started = time.monotonic()
    result = rounds.scrape_round(tel.client, tel.keys, http)
    elapsed_s = time.monotonic() - started

    assert elapsed_s < 10.0  # the deadline plus at most one read timeout, with room for a busy machine
    assert (result.scraped, result.failed) == (2, 1)
    assert "longer than" in MetricSample.objects.get(node=slow).error
    assert MetricSample.objects.get(node=fine).ok


@pytest.mark.django_db(transaction=True)  # the foreign keys are checked at commit, as in production
def test_a_node_deleted_while_it_is_scraped_does_not_cost_the_others_their_round(tel, http, stubs):
    regions = make_regions("us-east")
    gone = make_node("use-1", regions["us-east"], stubs(metrics=Counters().page).url)
    kept = make_node("use-2", regions["us-east"], stubs(metrics=Counters().page).url)
    fetch_all = http.fetch_all

    def fetch_then_delete(targets, timeout_s):
        fetched = fetch_all(targets, timeout_s)
        gone.delete()  # an operator removes the node while the round waits for the fleet
        return fetched

    http.fetch_all = fetch_then_delete
    result = rounds.scrape_round(tel.client, tel.keys, http)

    assert result.failed == 0
    assert MetricSample.objects.get(node=kept).ok
    assert not MetricSample.objects.filter(node_id=gone.pk).exists()
    assert live(tel, kept).num_running == 3
    assert tel.client.hget(tel.keys.live_nodes, str(gone.pk)) is None  # not brought back to life
