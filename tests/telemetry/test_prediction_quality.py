"""Prediction quality: the cost model's predicted TTFT against the measured one, per node.

Aggregated by the workers into the request buckets (signed error sums and a signed log histogram),
read back through the API, the breakdown page's data and the Prometheus endpoint.
"""

from __future__ import annotations

import math
import time
import uuid

import pytest
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from controlplane.histogram import signed_quantile_ms
from routing import contract
from routing.contract import CostTerms, RequestRecord
from telemetry.aggregation import apply_batch, predicted_ttft_ms, prediction_quality_of
from telemetry.models import RequestAggregate
from tests.telemetry.conftest import make_node, make_regions

pytestmark = pytest.mark.django_db

T0 = 0.0  # a 10 s bucket a minute before the test (_recent_bucket): inside the exporter's window


@pytest.fixture(autouse=True)
def _recent_bucket() -> None:
    """Taken when each test starts: a time taken at import left the exporter's 300 s window once
    the suite needed more than four minutes from collection to this file (a loaded full run)."""
    global T0
    T0 = math.floor(time.time() / 10) * 10 - 60.0


@pytest.fixture
def node(tel):
    regions = make_regions("us-east", "eu-central")
    return make_node("euc-1", regions["eu-central"], "http://127.0.0.1:9")


def record(node, ttft_ms: float | None, cost: CostTerms | None, **fields) -> RequestRecord:
    return RequestRecord(
        schema_version=contract.SCHEMA_VERSION,
        request_id=uuid.uuid4().hex,
        ts=T0 + 1,
        gateway_region="us-east",
        gateway_id="gw-1",
        model="m",
        status=200,
        stream=True,
        node_id=node.pk,
        node_region="eu-central",
        gateway_ms=2.0,
        ttft_ms=ttft_ms,
        total_ms=300.0,
        cost=cost,
        **fields,
    )


def priced(node, rtt_ms: float = 88.0, queue_ms: float = 10.0, prefill_ms: float = 50.0) -> CostTerms:
    # total_ms carries the policy's weights (here w_rtt = 2): the prediction must not use it.
    return CostTerms(
        node.pk,
        total_ms=2 * rtt_ms + queue_ms + prefill_ms,
        rtt_ms=rtt_ms,
        queue_ms=queue_ms,
        prefill_ms=prefill_ms,
    )


def add(*records: RequestRecord) -> None:
    apply_batch([(f"{int(T0 * 1000)}-{i}", r) for i, r in enumerate(records)], rtt=None)


def node_bucket(node) -> RequestAggregate:
    return RequestAggregate.objects.get(resolution="10s", scope="node", node=node)


def test_it_predicts_the_gateway_time_plus_the_unweighted_cost_terms(node) -> None:
    assert predicted_ttft_ms(record(node, 200.0, priced(node))) == pytest.approx(2.0 + 88.0 + 10.0 + 50.0)


def test_it_predicts_nothing_for_algorithms_that_price_nothing_or_another_node(node) -> None:
    assert predicted_ttft_ms(record(node, 200.0, None)) is None
    assert predicted_ttft_ms(record(node, 200.0, CostTerms(node.pk))) is None  # round robin's zeros
    assert predicted_ttft_ms(record(node, 200.0, CostTerms(node.pk + 1, rtt_ms=5.0))) is None


def test_it_aggregates_the_error_its_bias_and_its_distribution_per_node(node) -> None:
    # Predicted 150 ms each; measured 10 below, then 50, 100 and 300 ms above.
    add(*(record(node, 150.0 + error, priced(node)) for error in (-10.0, 50.0, 100.0, 300.0)))
    quality = prediction_quality_of(node_bucket(node))
    assert quality is not None and quality.count == 4
    assert quality.bias_ms == pytest.approx((-10 + 50 + 100 + 300) / 4)
    assert quality.mean_abs_error_ms == pytest.approx((10 + 50 + 100 + 300) / 4)
    assert quality.median_abs_error_ms == pytest.approx(50.0, rel=0.05)
    assert quality.error_p10_ms == pytest.approx(-10.0, rel=0.05)
    assert quality.error_p90_ms == pytest.approx(300.0, rel=0.05)


def test_it_leaves_requests_without_a_prediction_or_a_first_token_out(node) -> None:
    add(record(node, 150.0, None), record(node, None, priced(node)), record(node, 400.0, priced(node)))
    row = node_bucket(node)
    assert row.count == 3 and row.prediction_count == 1
    assert row.prediction_error_sum_ms == pytest.approx(400.0 - 150.0)


def test_it_adds_batches_into_the_same_bucket(node) -> None:
    add(record(node, 160.0, priced(node)))
    apply_batch([(f"{int(T0 * 1000)}-9", record(node, 140.0, priced(node)))], rtt=None)
    row = node_bucket(node)
    assert row.prediction_count == 2 and row.prediction_error_sum_ms == pytest.approx(0.0)
    assert sum(row.prediction_error_histogram.values()) == 2


def test_it_orders_signed_errors_from_most_negative_to_most_positive() -> None:
    histogram = {"-50": 1, "-10": 1, "+10": 1, "+50": 1, "+60": 1}
    assert signed_quantile_ms(histogram, 0.2) < signed_quantile_ms(histogram, 0.4) < 0
    assert 0 < signed_quantile_ms(histogram, 0.6) < signed_quantile_ms(histogram, 1.0)
    assert signed_quantile_ms({}, 0.5) is None


def test_the_api_reports_it_per_bucket(node, viewer_api) -> None:
    add(*(record(node, 150.0 + 100.0, priced(node)) for _ in range(3)))
    answer = viewer_api.get("/api/v1/telemetry/request-aggregates/", {"scope": "node", "resolution": "10s"})
    assert answer.status_code == 200
    (row,) = answer.json()["results"]
    assert row["prediction"]["count"] == 3
    assert row["prediction"]["bias_ms"] == pytest.approx(100.0)
    assert row["prediction"]["median_abs_error_ms"] == pytest.approx(100.0, rel=0.05)


def test_prometheus_gets_the_median_absolute_error_bias_and_samples_per_node(node) -> None:
    add(*(record(node, 150.0 + error, priced(node)) for error in (200.0, 250.0, 300.0)))
    body = Client(REMOTE_ADDR="127.0.0.1").get("/metrics").content.decode()
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }
    labels = (("node", "euc-1"), ("region", "eu-central"))
    assert got[("gorgo_ttft_prediction_abs_error_median_seconds", labels)] == pytest.approx(0.25, rel=0.05)
    assert got[("gorgo_ttft_prediction_bias_seconds", labels)] == pytest.approx(0.25)
    assert got[("gorgo_ttft_prediction_samples", labels)] == 3
