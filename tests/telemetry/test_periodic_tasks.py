"""The Celery side: queues, time limits, expiry, locks, quiet returns, retention."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.conf import settings
from django.utils import timezone

from controlplane.celery import app as celery_app
from controlplane.locks import task_lock
from telemetry import rounds, tasks
from telemetry.models import (
    HealthEvent,
    KeyUsageAggregate,
    MetricSample,
    ProcessedRequestEntry,
    RequestAggregate,
    RTTSample,
)
from tests.telemetry.conftest import make_node, make_regions

pytestmark = pytest.mark.django_db

PERIODIC = (
    "telemetry.probe_fanout",
    "telemetry.scrape_metrics",
    "telemetry.aggregate_requests",
    "telemetry.prune",
)


def queue_of(name: str, *args) -> str:
    return celery_app.amqp.router.route({}, name, args=args, kwargs={})["queue"].name


def test_it_routes_region_probes_to_the_region_queue_and_the_rest_to_the_default():
    assert queue_of("telemetry.probe_region", "ap-south") == "probe.ap-south"
    assert queue_of("telemetry.scrape_metrics") == settings.CELERY_TASK_DEFAULT_QUEUE
    assert queue_of("telemetry.aggregate_requests") == settings.CELERY_TASK_DEFAULT_QUEUE


def test_every_periodic_task_has_time_limits_an_expiry_and_a_schedule():
    scheduled = {entry["task"]: entry for entry in settings.CELERY_BEAT_SCHEDULE.values()}
    for name in PERIODIC:
        entry = scheduled[name]
        assert 0 < entry["options"]["expires"] <= entry["schedule"]
        task = celery_app.tasks[name]
        assert 0 < task.soft_time_limit < task.time_limit
    probe = celery_app.tasks["telemetry.probe_region"]
    assert 0 < probe.soft_time_limit < probe.time_limit


def test_the_fanout_enqueues_one_expiring_probe_per_region(tel, monkeypatch):
    make_regions("us-east", "eu-central", "ap-south")
    sent = []
    monkeypatch.setattr(tasks.probe_region, "apply_async", lambda **kw: sent.append(kw))

    assert tasks.probe_fanout() == 3

    assert sorted(call["args"][0] for call in sent) == ["ap-south", "eu-central", "us-east"]
    assert all(call["expires"] == settings.GORGO_PROBE_INTERVAL_S for call in sent)


def test_a_task_returns_quietly_while_another_run_holds_its_lock(tel):
    with task_lock(tel.client, tel.keys, "scrape", ttl_s=30) as acquired:
        assert acquired
        assert tasks.scrape_metrics() is None
        with task_lock(tel.client, tel.keys, "scrape", ttl_s=30) as second:
            assert second is False
    assert tasks.scrape_metrics() == {"scraped": 0, "failed": 0, "transitions": 0}


def test_a_lock_that_expired_and_was_taken_over_is_not_released_by_its_first_owner(tel):
    key = tel.keys.lock("aggregate")
    with task_lock(tel.client, tel.keys, "aggregate", ttl_s=30):
        tel.client.set(key, "another-run")  # ours expired; another run holds it now
    assert tel.client.get(key) == b"another-run"


def test_a_probe_for_a_removed_region_returns_quietly(tel):
    assert tasks.probe_region("atlantis") is None


def test_prune_keeps_raw_samples_a_day_and_rollups_a_month(tel):
    region = make_regions("us-east")["us-east"]
    node = make_node("use-1", region, "http://127.0.0.1:9")
    now = timezone.now()
    two_days, two_months = now - timedelta(days=2), now - timedelta(days=60)
    for ts in (now, two_days):
        RTTSample.objects.create(region=region, node=node, ts=ts, ok=True, rtt_ms=1.0)
        MetricSample.objects.create(node=node, ts=ts, ok=True)
        ProcessedRequestEntry.objects.create(stream_id=f"{ts.timestamp()}-0", processed_at=ts)
    for ts in (now, two_days, two_months):
        for resolution in ("10s", "1m"):
            RequestAggregate.objects.create(resolution=resolution, scope="node", node=node, bucket_start=ts)
            KeyUsageAggregate.objects.create(resolution=resolution, key_id="k1", bucket_start=ts)
        HealthEvent.objects.create(node=node, ts=ts, previous="healthy", current="unhealthy", source="probe")

    deleted = rounds.prune(tel.client, tel.keys, chunk=1)

    assert deleted["rtt_samples"] == deleted["metric_samples"] == deleted["processed_entries"] == 1
    assert deleted["aggregates_10s"] == 2 and deleted["aggregates_1m"] == 1 and deleted["health_events"] == 1
    assert deleted["key_usage_10s"] == 2 and deleted["key_usage_1m"] == 1
    assert sorted(
        KeyUsageAggregate.objects.values_list("resolution", "bucket_start").order_by(
            "resolution", "bucket_start"
        )
    ) == [("10s", now), ("1m", two_days), ("1m", now)]
    assert list(RTTSample.objects.values_list("ts", flat=True)) == [now]
    assert sorted(
        RequestAggregate.objects.filter(resolution="1m").values_list("bucket_start", flat=True)
    ) == [
        two_days,
        now,
    ]
    assert HealthEvent.objects.count() == 2


def test_the_queue_list_command_names_every_region_queue(db, capsys):
    from django.core.management import call_command

    make_regions("us-east", "ap-south")

    call_command("telemetry_queues")

    assert (
        capsys.readouterr().out.strip()
        == f"{settings.CELERY_TASK_DEFAULT_QUEUE},probe.ap-south,probe.us-east"
    )
