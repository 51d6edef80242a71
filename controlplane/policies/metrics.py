"""What the policies export to Prometheus: the published version and the publishes
(registered with core's ``exports_metrics``, ``controlplane/metrics.py``)."""

from __future__ import annotations

from collections.abc import Iterator

from django.db.models import Count
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from controlplane.metrics import exports_metrics
from controlplane.policies.models import PolicyVersion
from controlplane.policies.publishing import live_version


@exports_metrics
def policy_metrics() -> Iterator[Metric]:
    live = live_version()
    yield GaugeMetricFamily(
        "gorgo_controlplane_policy_version",
        "Version of the policy snapshot the control plane last published (0: none yet).",
        value=live.number if live else 0,
    )
    yield GaugeMetricFamily(
        "gorgo_controlplane_policy_published_timestamp_seconds",
        "When that version was published (unix seconds; 0: never).",
        value=live.published_at.timestamp() if live and live.published_at else 0,
    )
    publishes = CounterMetricFamily(
        "gorgo_controlplane_policy_publishes",
        "Policy versions published (edits, fleet-change republishes, rollbacks), by policy.",
        labels=["policy"],
    )
    rows = (
        PolicyVersion.objects.filter(published_at__isnull=False)
        .values("policy__name")
        .annotate(count=Count("pk"))
        .order_by("policy__name")
    )
    for row in rows:
        publishes.add_metric([row["policy__name"]], row["count"])
    yield publishes
