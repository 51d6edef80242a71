"""RTT probes: region header, kept-alive connections, EWMA + jitter in Redis, samples, the live table."""

from __future__ import annotations

import pytest

from routing import contract
from routing.contract import RTTTable
from simulator.harness import free_port
from telemetry import rounds
from telemetry.live import update_rtt
from telemetry.models import RTTSample
from telemetry.probes import NodeHTTP, Target
from tests.telemetry.conftest import make_node, make_regions

pytestmark = pytest.mark.django_db


def test_it_sends_the_probing_region_and_measures_its_delay(http, stubs):
    stub = stubs(region_delays_ms={"ap-south": 60.0})

    far = http.probe("ap-south", Target(1, stub.url), timeout_s=2.0)
    near = http.probe("us-east", Target(1, stub.url), timeout_s=2.0)

    assert stub.seen_regions == ["ap-south", "us-east"]
    assert far.ok and near.ok
    # The delay is a floor the probe cannot beat; no upper bound (that would time the machine).
    assert far.rtt_ms >= 60.0
    assert stub.applied_delays_ms == [60.0, 0.0]  # the near probe was not delayed
    assert near.rtt_ms is not None and near.rtt_ms >= 0.0


def test_it_keeps_the_connection_and_times_a_new_one_separately(http, stubs):
    stub = stubs()

    first = http.probe("us-east", Target(1, stub.url), timeout_s=2.0)
    second = http.probe("us-east", Target(1, stub.url), timeout_s=2.0)

    assert first.connect_ms is not None and first.connect_ms >= 0.0  # a new connection
    assert second.connect_ms is None  # the kept-alive one


def test_it_reports_a_refused_connection_and_an_error_status(http, stubs):
    stub = stubs()
    stub.health_status = 503

    down = http.probe("us-east", Target(1, f"http://127.0.0.1:{free_port()}"), timeout_s=1.0)
    sick = http.probe("us-east", Target(2, stub.url), timeout_s=1.0)

    assert not down.ok and "ConnectError" in down.error and down.rtt_ms is None
    assert not sick.ok and sick.status_code == 503 and "503" in sick.error


def test_it_keeps_an_ewma_and_jitter_per_region_and_node(tel):
    update_rtt(tel.client, tel.keys, "eu-central", {7: 100.0}, now=1.0)
    update_rtt(tel.client, tel.keys, "eu-central", {7: 110.0}, now=2.0)
    (entry,) = update_rtt(tel.client, tel.keys, "eu-central", {7: 90.0}, now=3.0)
    (other,) = update_rtt(tel.client, tel.keys, "us-east", {7: 5.0}, now=3.0)

    # ewma (alpha 0.3): 100 -> 103 -> 99.1; jitter (mean deviation, gain 0.25): 0 -> 2.5 -> 2.5 + 0.25 * (13 - 2.5)
    assert entry.rtt_ms == pytest.approx(99.1)
    assert entry.jitter_ms == pytest.approx(5.125)
    assert entry.samples == 3
    assert other.rtt_ms == 5.0 and other.samples == 1


def test_a_probe_round_stores_samples_and_publishes_the_rtt_table(tel, http, stubs):
    regions = make_regions("us-east", "ap-south")
    near = stubs(region_delays_ms={"ap-south": 40.0})
    far = stubs(region_delays_ms={"us-east": 40.0})
    node_near = make_node("use-1", regions["us-east"], near.url)
    node_far = make_node("aps-1", regions["ap-south"], far.url)
    pubsub = tel.client.pubsub()
    pubsub.subscribe(tel.keys.live_channel)
    pubsub.get_message(timeout=1.0)  # the subscribe confirmation

    result = rounds.probe_round(tel.client, tel.keys, http, "us-east")
    rounds.probe_round(tel.client, tel.keys, http, "us-east")

    assert result.probed == 2 and result.failed == 0
    samples = RTTSample.objects.filter(region=regions["us-east"])
    assert samples.count() == 4
    assert all(s.ok for s in samples)
    assert min(s.rtt_ms for s in samples.filter(node=node_far)) >= 40.0
    table = contract.decode(tel.client.get(tel.keys.live_rtt), RTTTable)
    by_node = {(e.region, e.node_id): e for e in table.entries}
    assert by_node[("us-east", node_far.pk)].rtt_ms >= 40.0
    assert near.applied_delays_ms == [0.0, 0.0]  # probed from us-east: no emulated delay
    # The table holds the EWMA (alpha 0.3) of exactly the samples stored, not a timing guess.
    first, second = samples.filter(node=node_near).order_by("ts").values_list("rtt_ms", flat=True)
    assert by_node[("us-east", node_near.pk)].rtt_ms == pytest.approx(0.7 * first + 0.3 * second, abs=0.01)
    assert by_node[("us-east", node_far.pk)].samples == 2
    message = pubsub.get_message(timeout=2.0)
    assert message is not None and message["data"] == tel.keys.live_rtt.encode()
    pubsub.close()


def test_a_probe_round_keeps_other_regions_entries(tel, http, stubs):
    regions = make_regions("us-east", "eu-central")
    node = make_node("use-1", regions["us-east"], stubs().url)

    rounds.probe_round(tel.client, tel.keys, http, "us-east")
    rounds.probe_round(tel.client, tel.keys, http, "eu-central")

    table = contract.decode(tel.client.get(tel.keys.live_rtt), RTTTable)
    assert {(e.region, e.node_id) for e in table.entries} == {("us-east", node.pk), ("eu-central", node.pk)}


def test_a_dead_nodes_mark_comes_back_in_a_redis_that_lost_everything(tel, http):
    """Redis restarted empty: the next probe round that finds the node still down writes its
    entry again, unhealthy as the database says (before, only a transition wrote it, so the
    gateways routed to the dead node as unmeasured for as long as it stayed down)."""
    node = make_node("use-1", make_regions("us-east")["us-east"], f"http://127.0.0.1:{free_port()}")
    for _ in range(3):
        rounds.probe_round(tel.client, tel.keys, http, "us-east")
    tel.client.delete(*tel.client.keys(f"{tel.keys.prefix}:*"))  # this test's namespace only

    rounds.probe_round(tel.client, tel.keys, http, "us-east")

    raw = tel.client.hget(tel.keys.live_nodes, str(node.pk))
    assert raw is not None and contract.decode(raw, contract.NodeLiveState).healthy is False


def test_a_probe_round_for_a_removed_region_does_nothing(tel, http):
    assert rounds.probe_round(tel.client, tel.keys, http, "atlantis") is None
    assert tel.client.get(tel.keys.live_rtt) is None


def test_it_talks_to_the_node_itself_even_with_a_proxy_in_the_environment(stubs, monkeypatch):
    # The gateways connect to nodes directly; a probe through the worker's HTTP_PROXY measured the
    # proxy's round trip (and its connection to the node), and a scrape read what the proxy said.
    node, proxy = stubs(), stubs()
    monkeypatch.setenv("HTTP_PROXY", proxy.url)
    monkeypatch.setenv("http_proxy", proxy.url)
    http = NodeHTTP(keepalive_s=60.0, max_parallel=2)
    try:
        probe = http.probe("us-east", Target(1, node.url), timeout_s=2.0)
        fetch = http.fetch_metrics(Target(1, node.url), timeout_s=2.0)
    finally:
        http.close()

    assert probe.ok and fetch.text is not None
    assert (node.health_requests, proxy.health_requests) == (1, 0)
    assert node.seen_regions == ["us-east"]


@pytest.mark.django_db(transaction=True)  # the foreign keys are checked at commit, as in production
def test_a_node_deleted_while_it_is_probed_does_not_cost_the_others_their_round(tel, http, stubs):
    regions = make_regions("us-east")
    gone = make_node("use-1", regions["us-east"], stubs().url)
    kept = make_node("use-2", regions["us-east"], stubs().url)
    probe_all = http.probe_all

    def probe_then_delete(region, targets, timeout_s):
        results = probe_all(region, targets, timeout_s)
        gone.delete()  # an operator removes the node while the round waits for the fleet
        return results

    http.probe_all = probe_then_delete
    result = rounds.probe_round(tel.client, tel.keys, http, "us-east")

    assert result is not None and result.failed == 0
    assert RTTSample.objects.get(node=kept).ok
    assert not RTTSample.objects.filter(node_id=gone.pk).exists()
    table = contract.decode(tel.client.get(tel.keys.live_rtt), RTTTable)
    assert [entry.node_id for entry in table.entries] == [kept.pk]
