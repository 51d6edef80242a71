"""The online tuner on the control plane: windows from the request log, steps published as versions.

Windows are driven explicitly (``tune_policy(policy, now_s)``) with request records written to the
real Redis request stream, as the gateways write them.
"""

from __future__ import annotations

import itertools
import random

import pytest

from controlplane.connections import redis_client
from controlplane.locks import task_lock
from controlplane.policies import publishing, tasks, tuning
from controlplane.policies.models import PolicyVersion, RoutingPolicy, TuningWindow
from routing.contract import REQUEST_STREAM_FIELD, SCHEMA_VERSION, RequestRecord, encode

pytestmark = pytest.mark.django_db(transaction=True)
_SEQUENCE = itertools.count()  # stream ids must grow


@pytest.fixture
def tuned(settings, fleet, cp_keys) -> RoutingPolicy:
    settings.GORGO_TUNER_WINDOW_S = 5.0
    settings.GORGO_TUNER_MIN_REQUESTS = 20
    policy = RoutingPolicy.objects.create(
        name="tuned", algorithm="gorgo", params={"w_rtt": 4.0, "w_queue": 0.25}, auto_tune=True
    )
    publishing.publish(policy)
    return policy


def log_requests(version: PolicyVersion, ttft_ms: float, count: int = 30) -> None:
    """What the gateways append to the request log for requests routed with ``version``."""
    client, key = redis_client(), publishing.redis_keys().request_stream
    at_ms = int(version.published_at.timestamp() * 1000) + 3000
    for index in range(count):
        record = RequestRecord(
            schema_version=SCHEMA_VERSION,
            request_id=f"{version.number}-{index}",
            ts=at_ms / 1000,
            gateway_region="us-east",
            gateway_id="gw",
            model="m",
            status=200,
            stream=True,
            policy_version=version.number,
            ttft_ms=ttft_ms + index,
        )
        client.xadd(key, {REQUEST_STREAM_FIELD: encode(record)}, id=f"{at_ms}-{next(_SEQUENCE)}")


def tick(policy: RoutingPolicy, after_s: float = 10.0) -> TuningWindow | None:
    live = publishing.live_version()
    assert live is not None and live.published_at is not None
    return tuning.tune_policy(policy, live.published_at.timestamp() + after_s, random.Random(1))


def test_it_measures_then_publishes_a_trial_as_a_version_by_the_tuner(tuned) -> None:
    v1 = publishing.live_version()
    log_requests(v1, 300.0)
    window = tick(tuned)
    assert window is not None and window.outcome == "measured"
    assert (window.w_rtt, window.w_queue) == (4.0, 0.25)
    assert window.requests == 30
    v2 = publishing.live_version()
    assert window.version == v2 and v2.number == v1.number + 1
    assert v2.author_name == tuning.TUNER_AUTHOR
    assert "w_rtt=4, w_queue=0.25 measured p95" in v2.note and "over 30 requests" in v2.note
    tuned.refresh_from_db()
    trial = (tuned.params["w_rtt"], tuned.params["w_queue"])
    assert trial != (4.0, 0.25)
    assert all(0.1 <= w <= 10.0 for w in trial)


def test_it_reverts_when_the_trial_worsens_p95(tuned) -> None:
    log_requests(publishing.live_version(), 300.0)
    tick(tuned)
    log_requests(publishing.live_version(), 600.0)  # the trial is worse
    window = tick(tuned)
    assert window is not None and window.outcome == "rejected"
    v3 = publishing.live_version()
    assert window.version == v3 and v3.author_name == tuning.TUNER_AUTHOR
    assert v3.note.startswith("tuner: reverted to w_rtt=4, w_queue=0.25")
    tuned.refresh_from_db()
    assert (tuned.params["w_rtt"], tuned.params["w_queue"]) == (4.0, 0.25)


def test_it_keeps_a_better_trial(tuned) -> None:
    log_requests(publishing.live_version(), 600.0)
    tick(tuned)
    trial = TuningWindow.objects.get().state["trial"]
    log_requests(publishing.live_version(), 200.0)
    window = tick(tuned)
    assert window is not None and window.outcome == "accepted"
    assert window.state["incumbent"] == trial
    assert "tuner: accepted" in publishing.live_version().note


def test_it_waits_for_a_full_window_with_enough_requests(tuned) -> None:
    v1 = publishing.live_version()
    log_requests(v1, 300.0, count=10)
    assert tick(tuned) is None  # too few requests
    log_requests(v1, 300.0, count=30)
    assert tick(tuned, after_s=4.0) is None  # too early
    assert PolicyVersion.objects.count() == 1 and not TuningWindow.objects.exists()


def test_it_counts_only_requests_routed_with_the_live_version(tuned) -> None:
    v1 = publishing.live_version()
    log_requests(v1, 300.0)
    tick(tuned)
    assert tick(tuned) is None  # the new trial has no requests of its own yet


def test_it_restarts_from_what_an_operator_published(tuned) -> None:
    log_requests(publishing.live_version(), 300.0)
    tick(tuned)
    tuned.params = {"w_rtt": 1.0, "w_queue": 1.0}
    tuned.save()
    publishing.publish(tuned, note="by hand")
    log_requests(publishing.live_version(), 300.0)
    window = tick(tuned)
    assert window is not None and window.outcome == "measured"
    assert (window.w_rtt, window.w_queue) == (1.0, 1.0)


def test_it_does_not_publish_over_unsaved_operator_edits(tuned) -> None:
    log_requests(publishing.live_version(), 300.0)
    tuned.max_rtt_ms = 150.0
    tuned.save()  # a draft the operator has not published
    assert tick(tuned) is None
    assert PolicyVersion.objects.count() == 1


def test_the_task_runs_only_for_an_active_policy_with_tuning_on(tuned) -> None:
    RoutingPolicy.objects.filter(pk=tuned.pk).update(auto_tune=False)
    assert tasks.tune() is None


def test_the_task_never_overlaps_itself(tuned, cp_keys) -> None:
    log_requests(publishing.live_version(), 300.0)
    with task_lock(redis_client(), cp_keys, "policies-tune", 30) as acquired:
        assert acquired
        assert tasks.tune() is None
    assert not TuningWindow.objects.exists()


def test_tuning_is_refused_for_other_algorithms(operator_client) -> None:
    response = operator_client.post(
        "/api/v1/policies/",
        {"name": "ll", "algorithm": "least_load", "params": {}, "auto_tune": True},
        format="json",
    )
    assert response.status_code == 400
    assert "auto_tune" in response.json()


def test_the_api_switches_tuning_on(operator_client, fleet) -> None:
    response = operator_client.post(
        "/api/v1/policies/",
        {"name": "g", "algorithm": "gorgo", "params": {}, "auto_tune": True},
        format="json",
    )
    assert response.status_code == 201, response.json()
    assert response.json()["auto_tune"] is True
    assert RoutingPolicy.objects.get(name="g").auto_tune
