"""Per-key usage from the gateways' request records in Redis: status classes, tokens, TTFT, teams."""

from __future__ import annotations

import math
import time

import pytest

from controlplane.keys.models import ClientKey
from telemetry.aggregation import run_round
from telemetry.models import KeyUsageAggregate
from tests.telemetry.conftest import make_node, make_regions
from tests.telemetry.test_request_aggregation import append, at, record

pytestmark = pytest.mark.django_db

T0 = math.floor(time.time() / 60) * 60 - 120.0


def make_key(name: str, team: str, priority: str = "interactive") -> ClientKey:
    key = ClientKey(name=name, owner="ana", team=team, priority=priority)
    key.set_new_secret()
    key.save()
    return key


@pytest.fixture
def node(tel):
    regions = make_regions("us-east", "eu-central")
    return make_node("euc-1", regions["eu-central"], "http://127.0.0.1:9")


def usage(resolution: str, key: ClientKey, priority: str = "interactive") -> KeyUsageAggregate:
    return KeyUsageAggregate.objects.get(resolution=resolution, key_id=key.key_id, priority=priority)


def test_it_counts_each_keys_requests_tokens_errors_and_ttft(tel, node):
    search = make_key("search", "retrieval")
    batch = make_key("nightly", "analytics", priority="batch")
    keyed = {"key_id": search.key_id, "priority": "interactive"}
    append(
        tel,
        *(
            record(node, ts=T0 + 1 + i, ttft_ms=100.0 + 10 * i, completion_tokens=20, **keyed)
            for i in range(4)
        ),
        record(node, ts=T0 + 6, ttft_ms=None, status=429, prompt_tokens=None, prompt_tokens_est=30, **keyed),
        record(node, ts=T0 + 7, ttft_ms=None, status=403, prompt_tokens=None, prompt_tokens_est=30, **keyed),
        record(node, ts=T0 + 8, ttft_ms=None, status=502, error="euc-1: upstream failed", **keyed),
        record(node, ts=T0 + 9, ttft_ms=120.0, status=200, error="stream broke", **keyed),
        record(node, ts=T0 + 2, ttft_ms=300.0, key_id=batch.key_id, priority="batch", completion_tokens=5),
        record(node, ts=T0 + 3, ttft_ms=90.0),  # no key (auth off): not attributed to anyone
    )

    result = run_round(tel.client, tel.keys)

    assert result.added == 10
    row = usage("10s", search)
    assert (row.team, row.client_key_id, row.priority) == ("retrieval", search.pk, "interactive")
    assert (row.count, row.errors_4xx, row.errors_5xx, row.limited, row.refused) == (8, 2, 2, 1, 1)
    # 6 records carried the node's usage (100 prompt, 48 cached each); 2 refusals only the estimate.
    assert (row.usage_count, row.prompt_tokens, row.cached_tokens) == (6, 660, 288)
    assert row.completion_tokens == 80
    assert row.ttft_count == 5 and row.ttft_mean_ms == pytest.approx(116.0)
    assert row.ttft_p50_ms == pytest.approx(120.0, rel=0.03)
    assert row.ttft_p99_ms == pytest.approx(130.0, rel=0.03)
    minute = usage("1m", search)
    assert (minute.count, minute.prompt_tokens, minute.bucket_start) == (8, 660, at(T0))
    other = usage("10s", batch, priority="batch")
    assert (other.team, other.count, other.completion_tokens) == ("analytics", 1, 5)
    assert KeyUsageAggregate.objects.count() == 4  # two keys x two resolutions; the keyless one is not there


def test_replayed_entries_are_not_counted_twice(tel, node):
    key = make_key("search", "retrieval")
    ids = append(
        tel,
        *(
            record(node, ts=T0 + 1, ttft_ms=100.0, key_id=key.key_id, priority="interactive")
            for _ in range(3)
        ),
    )
    run_round(tel.client, tel.keys)
    # A fresh consumer group delivers the same entries again (as a takeover after a crash would).
    tel.client.xgroup_destroy(tel.keys.request_stream, tel.keys.request_group)

    result = run_round(tel.client, tel.keys)

    assert result.added == 0 and result.duplicates == len(ids)
    assert usage("10s", key).count == 3 and usage("1m", key).count == 3


def test_a_deleted_keys_usage_stays_under_its_id_and_team(tel, node):
    key = make_key("old", "legacy")
    key_id = key.key_id
    append(tel, record(node, ts=T0 + 1, ttft_ms=100.0, key_id=key_id))
    run_round(tel.client, tel.keys)
    key.delete()
    append(tel, record(node, ts=T0 + 2, ttft_ms=100.0, key_id=key_id))

    run_round(tel.client, tel.keys)

    row = KeyUsageAggregate.objects.get(resolution="10s", key_id=key_id)
    assert (row.count, row.team, row.client_key_id) == (2, "legacy", None)


def test_a_record_with_a_foreign_key_id_does_not_stall_the_batch(tel, node):
    key = make_key("search", "retrieval")
    append(
        tel,
        record(node, ts=T0 + 1, ttft_ms=100.0, key_id="k" * 40, priority="interactive"),
        record(node, ts=T0 + 2, ttft_ms=100.0, key_id=key.key_id, priority="interactive-but-much-longer"),
    )

    result = run_round(tel.client, tel.keys)

    assert result.added == 2
    assert list(KeyUsageAggregate.objects.filter(resolution="10s").values_list("key_id", "priority")) == [
        (key.key_id, "interactive-but-")
    ]
