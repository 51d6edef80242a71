"""Pushes to the dashboard group through the channel layer (on Redis), and their shapes."""

from __future__ import annotations

import asyncio
import math
import time
import uuid

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

from routing import contract
from routing.contract import REQUEST_STREAM_FIELD, RequestRecord
from telemetry import rounds, tasks
from telemetry.groups import DASHBOARD_GROUP
from telemetry.health import Outcome
from tests.telemetry.conftest import make_node, make_regions

pytestmark = pytest.mark.django_db


@pytest.fixture
def listen(tel):
    """A channel in the dashboard group (as the dashboard consumer would join), and a receiver."""
    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(DASHBOARD_GROUP, channel)

    async def _receive(timeout_s: float) -> dict:
        return await asyncio.wait_for(layer.receive(channel), timeout_s)

    def receive(type_: str, timeout_s: float = 5.0) -> dict:
        while True:  # skip updates of other kinds the round also sent
            message = async_to_sync(_receive)(timeout_s)
            if message["type"] == type_:
                return message

    yield receive
    async_to_sync(layer.group_discard)(DASHBOARD_GROUP, channel)


def test_a_probe_round_pushes_the_region_rtt_row(tel, http, stubs, listen):
    node = make_node("use-1", make_regions("us-east")["us-east"], stubs(region_delays_ms={"us-east": 5}).url)

    rounds.probe_round(tel.client, tel.keys, http, "us-east")

    message = listen("telemetry.rtt")
    assert message["region"] == "us-east"
    (cell,) = message["cells"]
    assert cell["node_id"] == node.pk and cell["ok"] is True
    assert cell["rtt_ms"] >= 5.0 and cell["last_ms"] >= 5.0
    assert set(cell) == {"node_id", "ok", "rtt_ms", "jitter_ms", "last_ms", "connect_ms"}


def test_a_scrape_round_pushes_every_node(tel, http, stubs, listen):
    node = make_node("use-1", make_regions("us-east")["us-east"], stubs().url)

    rounds.scrape_round(tel.client, tel.keys, http)

    message = listen("telemetry.nodes")
    (cell,) = message["nodes"]
    assert (cell["node_id"], cell["scrape_ok"], cell["num_running"], cell["kv_cache_usage"]) == (
        node.pk,
        True,
        4.0,
        0.0625,
    )
    assert {"healthy", "prefix_hit_rate", "ttft_p50_ms", "queue_mean_ms", "prefill_mean_ms"} <= set(cell)


def test_a_health_transition_is_pushed_once(tel, listen):
    node = make_node("use-1", make_regions("us-east")["us-east"], "http://127.0.0.1:9")

    for _ in range(3):
        rounds.settle(
            tel.client,
            tel.keys,
            "probe",
            [Outcome(node.pk, False, "refused")],
            {},
            healthy_default={},
            announce=False,
        )

    message = listen("telemetry.health")
    assert (
        message["node_id"],
        message["node"],
        message["previous"],
        message["current"],
        message["source"],
    ) == (
        node.pk,
        "use-1",
        "unknown",
        "unhealthy",
        "probe",
    )


def test_an_aggregation_round_pushes_the_changed_buckets_with_their_breakdown(tel, listen):
    node = make_node("use-1", make_regions("us-east")["us-east"], "http://127.0.0.1:9")
    ts = math.floor(time.time() / 10) * 10 - 20.0
    rec = RequestRecord(
        schema_version=contract.SCHEMA_VERSION,
        request_id=uuid.uuid4().hex,
        ts=ts + 1,
        gateway_region="us-east",
        gateway_id="gw",
        model="m",
        status=200,
        stream=True,
        node_id=node.pk,
        gateway_ms=1.0,
        ttft_ms=100.0,
        total_ms=300.0,
    )
    tel.client.xadd(tel.keys.request_stream, {REQUEST_STREAM_FIELD: contract.encode(rec)})

    summary = tasks.aggregate_requests()

    assert summary["added"] == 1
    message = listen("telemetry.aggregates")
    assert message["resolution"] == "10s"
    scopes = {(b["scope"], b["key"]): b for b in message["buckets"]}
    # The region's bucket, and its split: served in the region (the node is in us-east).
    assert set(scopes) == {("node", str(node.pk)), ("region", "us-east"), ("local", "us-east")}
    bucket = scopes[("node", str(node.pk))]
    assert (bucket["bucket_start"], bucket["count"]) == (ts, 1)
    assert bucket["breakdown"]["ttft_mean_ms"] == 100.0 and bucket["breakdown"]["gateway_ms"] == 1.0
