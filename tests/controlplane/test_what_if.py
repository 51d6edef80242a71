"""What-if API: replay the request log's last minutes with a policy's draft and with the live policy.

Records are written to the real Redis request stream as the gateways write them, with stream ids at
their arrival times; the run's Celery task is executed in the test (its ``delay`` runs it inline).
"""

from __future__ import annotations

import itertools
import time

import pytest

from controlplane.connections import redis_client, redis_keys
from controlplane.policies import publishing, tasks, whatif
from controlplane.policies.models import RoutingPolicy
from routing.contract import (
    REQUEST_STREAM_FIELD,
    SCHEMA_VERSION,
    RequestRecord,
    RTTEntry,
    RTTTable,
    encode,
)
from tests.controlplane.support import LLAMA

pytestmark = pytest.mark.django_db(transaction=True)
_SEQUENCE = itertools.count()
REGIONS = ("us-east", "eu-central", "ap-south")


@pytest.fixture
def inline_runs(monkeypatch) -> None:
    """Run the what-if task at once, in the test, instead of on a worker."""
    monkeypatch.setattr(tasks.what_if, "delay", lambda *args: tasks.what_if(*args))


@pytest.fixture
def live(fleet, cp_keys) -> RoutingPolicy:
    policy = RoutingPolicy.objects.create(name="live", algorithm="gorgo")
    publishing.publish(policy)
    return policy


@pytest.fixture
def draft(live) -> RoutingPolicy:
    return RoutingPolicy.objects.create(name="draft", algorithm="round_robin")


def write_rtt_table(fleet) -> None:
    """What telemetry's probes measured: 2 ms inside a region, 150 ms between regions."""
    now = time.time()
    entries = tuple(
        RTTEntry(region, node.pk, 2.0 if node.region.slug == region else 150.0, 0.5, 10, now)
        for region in REGIONS
        for node in fleet.nodes.values()
    )
    redis_client().set(redis_keys().live_rtt, encode(RTTTable(SCHEMA_VERSION, now, entries)))


def log_requests(fleet, count: int = 60, *, ago_s: float = 120.0, status: int = 200) -> None:
    """Requests the live policy served in the last minutes: local nodes, ~110 ms TTFT."""
    client, key = redis_client(), redis_keys().request_stream
    start = time.time() - ago_s
    nodes = {slug: [n for n in fleet.nodes.values() if n.region.slug == slug] for slug in REGIONS}
    for index in range(count):
        region = REGIONS[index % 3]
        node = nodes[region][index % 2]
        at_s = start + index * 0.5
        record = RequestRecord(
            schema_version=SCHEMA_VERSION,
            request_id=f"r{index}",
            ts=at_s,
            gateway_region=region,
            gateway_id=f"gw-{region}",
            model=LLAMA,
            status=status,
            stream=True,
            node_id=node.pk,
            node_region=region,
            prompt_chars=4000,
            prompt_tokens_est=1000,
            prompt_tokens=1000,
            completion_tokens=32,
            gateway_ms=1.0,
            ttft_ms=110.0 + index % 7,
            prefix_hashes=tuple(range(index % 3, index % 3 + 15)),
        )
        stream_id = f"{int(at_s * 1000)}-{next(_SEQUENCE)}"
        client.xadd(key, {REQUEST_STREAM_FIELD: encode(record)}, id=stream_id)


def ask(client, policy_id: int, body: object):
    return client.post(f"/api/v1/policies/{policy_id}/what-if/", body, format="json")


def test_it_replays_the_window_with_the_draft_and_the_live_policy(
    operator_client, fleet, draft, inline_runs
) -> None:
    write_rtt_table(fleet)
    log_requests(fleet)
    queued = ask(operator_client, draft.pk, {"minutes": 5})
    assert queued.status_code == 202, queued.content
    assert queued.data["status"] == "pending"
    run = operator_client.get(queued.data["url"])
    assert run.status_code == 200
    assert run.data["status"] == "done", run.data
    result = run.data["result"]
    assert result["requests"] == 60 and result["live_policy"] == "live" and result["policy_name"] == "draft"
    assert result["with_prefix_hashes"] == 1.0 and not result["truncated"]
    live, draft_ttft, measured = result["live"], result["draft"], result["measured"]
    assert live["count"] == draft_ttft["count"] == measured["count"] == 60
    # gorgo keeps every request at home; round robin sends two thirds abroad (150 ms each way)
    assert live["cross_region_share"] == 0.0
    assert draft_ttft["cross_region_share"] == pytest.approx(2 / 3, abs=0.05)
    assert draft_ttft["p50_ms"] > live["p50_ms"] + 100
    assert measured["p50_ms"] == pytest.approx(113.0, abs=1)
    for distribution in (live, draft_ttft, measured):
        assert sum(distribution["histogram"]) == 60
        assert len(distribution["histogram"]) == len(result["histogram_edges_ms"]) - 1
        assert distribution["cdf"][-1][1] == 1.0


def test_it_answers_409_for_a_window_without_traffic(operator_client, fleet, draft) -> None:
    log_requests(fleet, ago_s=30 * 60)  # all of it half an hour ago
    answer = ask(operator_client, draft.pk, {"minutes": 5})
    assert answer.status_code == 409
    assert "no request from the last 5 minute(s)" in answer.data["detail"]


def test_it_answers_409_when_nothing_is_live(operator_client, fleet, cp_keys) -> None:
    policy = RoutingPolicy.objects.create(name="first", algorithm="gorgo")
    answer = ask(operator_client, policy.pk, {"minutes": 5})
    assert answer.status_code == 409 and "publish one first" in answer.data["detail"]


def test_it_fails_the_run_when_the_window_only_held_client_errors(
    operator_client, fleet, draft, inline_runs
) -> None:
    log_requests(fleet, status=429)
    queued = ask(operator_client, draft.pk, {"minutes": 5})
    run = operator_client.get(queued.data["url"])
    assert run.data["status"] == "failed"
    assert "no request that reached a node" in run.data["error"]


@pytest.mark.parametrize("minutes", [0, 61, "15", 2.5, None])
def test_it_refuses_minutes_out_of_range_or_not_a_whole_number(operator_client, draft, minutes) -> None:
    answer = ask(operator_client, draft.pk, {"minutes": minutes})
    assert answer.status_code == 400 and "minutes" in answer.data


def test_it_answers_404_for_an_unknown_policy_or_run(operator_client, draft) -> None:
    assert ask(operator_client, 999_999, {"minutes": 5}).status_code == 404
    unknown_run = operator_client.get(f"/api/v1/policies/{draft.pk}/what-if/{'0' * 32}/")
    assert unknown_run.status_code == 404


def test_it_answers_400_for_an_invalid_draft(operator_client, fleet, live) -> None:
    broken = RoutingPolicy.objects.create(name="broken", algorithm="gorgo")
    RoutingPolicy.objects.filter(pk=broken.pk).update(params={"w_rtt": -1})  # as an old row could be
    log_requests(fleet)
    answer = ask(operator_client, broken.pk, {"minutes": 5})
    assert answer.status_code == 400 and "params" in answer.data


def test_it_keeps_runs_to_their_policy(operator_client, fleet, draft, live, inline_runs) -> None:
    log_requests(fleet)
    queued = ask(operator_client, draft.pk, {"minutes": 5})
    other = operator_client.get(f"/api/v1/policies/{live.pk}/what-if/{queued.data['id']}/")
    assert other.status_code == 404


def test_it_reads_the_newest_records_when_the_window_holds_more_than_the_limit(fleet, cp_keys) -> None:
    log_requests(fleet, count=30)
    records, truncated = whatif.read_records(redis_client(), time.time() - 600, limit=10)
    assert truncated and [r.request_id for r in records] == [f"r{i}" for i in range(20, 30)]
