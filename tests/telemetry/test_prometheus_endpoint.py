"""The control plane's /metrics: publish events, node health, RTT matrix, telemetry lag; access rules."""

from __future__ import annotations

import pytest
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from controlplane.policies.models import RoutingPolicy
from controlplane.policies.publishing import publish
from telemetry.live import merge_node_live, publish_rtt_table, update_rtt
from tests.controlplane.support import make_fleet

pytestmark = pytest.mark.django_db


def samples(body: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
    }


def test_it_exports_publishes_health_rtt_and_stream_lag(tel) -> None:
    fleet = make_fleet()
    policy = RoutingPolicy.objects.create(name="default", algorithm="round_robin")
    publish(policy, note="first")
    node = fleet.nodes["eu-central-1"]
    merge_node_live(
        tel.client,
        tel.keys,
        {node.pk: {"healthy": False, "last_probe_at": 1000.0, "last_scrape_at": 1001.0}},
        healthy_default={},
    )
    update_rtt(tel.client, tel.keys, "ap-south", {node.pk: 120.0}, now=1002.0)
    publish_rtt_table(tel.client, tel.keys, now=1002.0)
    tel.client.xadd(tel.keys.request_stream, {"r": "1"})
    tel.client.xgroup_create(tel.keys.request_stream, tel.keys.request_group, id="0")

    response = Client(REMOTE_ADDR="127.0.0.1").get("/metrics")

    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain; version=0.0.4")
    got = samples(response.content.decode())
    node_labels = (("node", "eu-central-1"), ("region", "eu-central"))
    assert got[("gorgo_controlplane_policy_version", ())] == 1
    assert got[("gorgo_controlplane_policy_publishes_total", (("policy", "default"),))] == 1
    assert got[("gorgo_controlplane_policy_published_timestamp_seconds", ())] > 0
    assert got[("gorgo_controlplane_redis_up", ())] == 1
    assert got[("gorgo_node_healthy", (*node_labels, ("state", "active")))] == 0
    assert got[("gorgo_telemetry_last_probe_timestamp_seconds", node_labels)] == 1000.0
    assert got[("gorgo_telemetry_last_scrape_timestamp_seconds", node_labels)] == 1001.0
    rtt_labels = (("node", "eu-central-1"), ("node_region", "eu-central"), ("region", "ap-south"))
    assert got[("gorgo_rtt_seconds", rtt_labels)] == pytest.approx(0.120)
    assert got[("gorgo_rtt_updated_timestamp_seconds", rtt_labels)] == 1002.0
    assert got[("gorgo_telemetry_request_stream_lag", ())] == 1
    # A node the workers never measured has no made-up series.
    assert not any(labels and ("node", "us-east-1") in labels for _name, labels in got)


def test_it_answers_only_loopback_without_a_token(tel) -> None:
    response = Client(REMOTE_ADDR="10.0.0.9").get("/metrics")

    assert response.status_code == 403
    assert b"GORGO_METRICS_TOKEN" in response.content


def test_it_wants_the_bearer_token_when_one_is_set(tel, settings) -> None:
    settings.GORGO_METRICS_TOKEN = "s3cret-token"
    remote = Client(REMOTE_ADDR="10.0.0.9")

    assert Client(REMOTE_ADDR="127.0.0.1").get("/metrics").status_code == 403  # loopback needs it too
    assert remote.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 403
    assert remote.get("/metrics", HTTP_AUTHORIZATION="Bearer s3cret-token").status_code == 200
    assert remote.post("/metrics", HTTP_AUTHORIZATION="Bearer s3cret-token").status_code == 405


def test_it_still_answers_when_redis_is_unreachable(tel, settings) -> None:
    from controlplane.connections import redis_client

    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    redis_client.cache_clear()
    try:
        response = Client(REMOTE_ADDR="127.0.0.1").get("/metrics")
    finally:
        redis_client.cache_clear()

    assert response.status_code == 200
    assert samples(response.content.decode())[("gorgo_controlplane_redis_up", ())] == 0


def test_it_counts_every_record_as_waiting_before_aggregation_first_runs(tel) -> None:
    before = samples(Client(REMOTE_ADDR="127.0.0.1").get("/metrics").content.decode())
    for index in range(3):
        tel.client.xadd(tel.keys.request_stream, {"r": str(index)})

    after = samples(Client(REMOTE_ADDR="127.0.0.1").get("/metrics").content.decode())

    assert before[("gorgo_telemetry_request_stream_lag", ())] == 0  # no stream at all yet
    assert after[("gorgo_telemetry_request_stream_lag", ())] == 3
    assert after[("gorgo_telemetry_request_stream_pending", ())] == 0
