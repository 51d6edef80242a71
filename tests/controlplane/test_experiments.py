"""Shadow and canary through the API (issue 23): each step publishes a version, audits, and refuses bad input."""

from __future__ import annotations

import pytest
from django.contrib.admin.models import LogEntry

from controlplane.connections import redis_client
from controlplane.policies import experiments
from controlplane.policies.models import PolicyExperiment, PolicyVersion, RoutingPolicy
from controlplane.policies.publishing import republish_active
from routing.contract import GorgoParams, decode_trial
from simulator.harness import free_port
from tests.controlplane.support import live_snapshot

URL = "/api/v1/policy-experiments/"


@pytest.fixture
def live(fleet, operator_client) -> RoutingPolicy:
    policy = RoutingPolicy.objects.create(name="default", algorithm="gorgo", params={"w_rtt": 1.0})
    assert operator_client.post(f"/api/v1/policies/{policy.pk}/publish/").status_code == 201
    return policy


@pytest.fixture
def candidate(fleet) -> RoutingPolicy:
    return RoutingPolicy.objects.create(name="candidate", algorithm="gorgo", params={"w_rtt": 0.0})


def start(client, **body):
    return client.post(URL, body, format="json")


def test_it_runs_a_draft_in_shadow_on_the_gateways(
    operator_client, live, candidate, redis_conn, cp_keys
) -> None:
    response = start(operator_client, kind="shadow", policy=candidate.pk, note="try w_rtt 0")
    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["kind"], body["status"], body["source_version"], body["started_version"]) == (
        "shadow",
        "running",
        None,
        2,
    )
    snapshot = live_snapshot(redis_conn, cp_keys)
    trial = decode_trial(snapshot.shadow)
    assert (snapshot.version, snapshot.policy.name, bool(snapshot.canary)) == (2, "default", False)
    assert (trial.id, trial.kind, trial.policy.name, trial.policy.params) == (
        body["id"],
        "shadow",
        "candidate",
        GorgoParams(w_rtt=0.0),
    )
    version = PolicyVersion.objects.get(number=2)
    assert version.note.startswith(f"shadow #{body['id']} (candidate draft) started: try w_rtt 0")
    entry = LogEntry.objects.get(object_id=str(body["id"]))
    assert entry.user.username == "op" and "Started shadow" in entry.change_message


def test_it_keeps_a_running_trial_through_a_fleet_republish(
    operator_client, live, candidate, fleet, redis_conn, cp_keys
) -> None:
    assert start(operator_client, kind="shadow", policy=candidate.pk).status_code == 201
    node = fleet.nodes["us-east-1"]
    node.state = "draining"
    node.save()
    republish_active("node drained")
    snapshot = live_snapshot(redis_conn, cp_keys)
    assert snapshot.version == 3 and decode_trial(snapshot.shadow).policy.name == "candidate"


def test_it_runs_a_stored_version_as_a_canary_and_stops_it(
    operator_client, live, candidate, redis_conn, cp_keys
) -> None:
    response = start(operator_client, kind="canary", version=1, share_percent=10)
    assert response.status_code == 201, response.content
    experiment_id = response.json()["id"]
    trial = decode_trial(live_snapshot(redis_conn, cp_keys).canary)
    assert (trial.kind, trial.share, trial.source_version, len(trial.salt)) == ("canary", 0.1, 1, 16)

    response = operator_client.post(f"{URL}{experiment_id}/stop/", {"note": "enough"}, format="json")
    assert response.status_code == 200, response.content
    assert (response.json()["status"], response.json()["ended_version"]) == ("stopped", 3)
    assert not live_snapshot(redis_conn, cp_keys).canary
    assert PolicyVersion.objects.get(number=3).note.endswith("stopped: enough")
    again = operator_client.post(f"{URL}{experiment_id}/stop/")
    assert again.status_code == 409 and "not running" in again.json()["detail"]


def test_it_promotes_a_canary_to_the_live_policy(
    operator_client, live, candidate, redis_conn, cp_keys
) -> None:
    experiment_id = start(operator_client, kind="canary", policy=candidate.pk, share_percent=50).json()["id"]
    response = operator_client.post(f"{URL}{experiment_id}/promote/")
    assert response.status_code == 200, response.content
    assert response.json()["status"] == "promoted"
    snapshot = live_snapshot(redis_conn, cp_keys)
    assert (snapshot.policy.name, snapshot.policy.params.w_rtt, bool(snapshot.canary)) == (
        "candidate",
        0.0,
        False,
    )
    assert PolicyVersion.objects.get(number=snapshot.version).author_name == "op"


def test_it_refuses_unknown_and_invalid_sources(
    operator_client, live, candidate, redis_conn, cp_keys
) -> None:
    unknown_version = start(operator_client, kind="shadow", version=99)
    assert unknown_version.status_code == 400
    assert "GET /api/v1/policy-versions/" in unknown_version.json()["version"][0]
    unknown_policy = start(operator_client, kind="shadow", policy=9999)
    assert unknown_policy.status_code == 400 and "GET /api/v1/policies/" in unknown_policy.json()["policy"][0]
    both = start(operator_client, kind="shadow", version=1, policy=candidate.pk)
    assert both.status_code == 400
    assert start(operator_client, kind="shadow").status_code == 400
    assert start(operator_client, kind="mirror", version=1).status_code == 400
    # A draft that does not validate is refused with its field errors.
    RoutingPolicy.objects.filter(pk=candidate.pk).update(params={"w_rtt": -1})
    invalid = start(operator_client, kind="shadow", policy=candidate.pk)
    assert invalid.status_code == 400 and "w_rtt: Must be at least 0." in invalid.json()["params"][0]
    assert not PolicyExperiment.objects.exists()
    assert live_snapshot(redis_conn, cp_keys).version == 1


def test_it_refuses_a_version_whose_models_are_gone(operator_client, fleet, candidate) -> None:
    policy = RoutingPolicy.objects.create(name="scoped", algorithm="least_load")
    policy.model_scope.add(fleet.model)
    assert operator_client.post(f"/api/v1/policies/{policy.pk}/publish/").status_code == 201
    version = PolicyVersion.objects.get(number=1)
    version.snapshot = version.snapshot.replace(fleet.model.name, "gone/model")
    version.save()
    response = start(operator_client, kind="shadow", version=1)
    assert response.status_code == 400 and "no longer exist (gone/model)" in response.json()["version"][0]


@pytest.mark.parametrize("share", [0, -5, 50.5, 100, None])
def test_it_refuses_a_canary_share_outside_0_to_50(operator_client, live, share) -> None:
    body = {"kind": "canary", "version": 1} | ({"share_percent": share} if share is not None else {})
    response = start(operator_client, **body)
    assert response.status_code == 400
    assert "more than 0 and at most 50" in response.json()["share_percent"][0]


def test_it_refuses_a_share_for_a_shadow(operator_client, live) -> None:
    assert start(operator_client, kind="shadow", version=1, share_percent=10).status_code == 400


def test_it_refuses_a_second_canary_while_one_runs(
    operator_client, live, candidate, redis_conn, cp_keys
) -> None:
    first = start(operator_client, kind="canary", version=1, share_percent=5).json()
    second = start(operator_client, kind="canary", policy=candidate.pk, share_percent=5)
    assert second.status_code == 409
    assert f"/api/v1/policy-experiments/{first['id']}/stop/" in second.json()["detail"]
    # A shadow may run beside the canary.
    assert start(operator_client, kind="shadow", policy=candidate.pk).status_code == 201
    assert PolicyExperiment.objects.filter(status="running").count() == 2


def test_it_refuses_a_trial_when_nothing_is_live(operator_client, candidate) -> None:
    response = start(operator_client, kind="shadow", policy=candidate.pk)
    assert response.status_code == 409 and "Publish a policy first" in response.json()["detail"]


def test_it_leaves_nothing_behind_when_redis_is_unreachable(
    operator_client, live, candidate, settings
) -> None:
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"
    redis_client.cache_clear()
    response = start(operator_client, kind="canary", policy=candidate.pk, share_percent=10)
    assert response.status_code == 503, response.content
    assert not PolicyExperiment.objects.exists()
    assert PolicyVersion.objects.count() == 1


def test_it_lets_only_publishers_start_and_stop(operator_client, viewer_client, live, candidate) -> None:
    assert start(viewer_client, kind="shadow", policy=candidate.pk).status_code == 403
    experiment_id = start(operator_client, kind="shadow", policy=candidate.pk).json()["id"]
    assert viewer_client.post(f"{URL}{experiment_id}/stop/").status_code == 403
    assert viewer_client.get(f"{URL}{experiment_id}/").status_code == 200


def _figures(canary_ms: float, rest_ms: float, n: int) -> dict:
    def arm(mean_ms: float) -> dict:
        # n samples at mean +- 20 ms (half each): variance 400 * n / (n - 1)
        return {
            "requests": n,
            "errors": 0,
            "ttft_count": n,
            "ttft_sum_ms": mean_ms * n,
            "ttft_sumsq_ms2": n * (mean_ms**2 + 400.0),
        }

    return {"regions": {"us-east": {"canary": arm(canary_ms), "live": arm(rest_ms)}}}


def test_it_rolls_a_worse_canary_back_automatically(
    operator_client, live, candidate, redis_conn, cp_keys
) -> None:
    body = start(
        operator_client, kind="canary", policy=candidate.pk, share_percent=10, margin_ms=20, min_samples=50
    )
    experiment = PolicyExperiment.objects.get(pk=body.json()["id"])
    experiment.figures = _figures(canary_ms=300, rest_ms=100, n=40)  # worse, but too few samples
    assert experiments.check_canary(experiment) is None
    experiment.figures = _figures(canary_ms=110, rest_ms=100, n=500)  # within the margin
    assert experiments.check_canary(experiment) is None
    experiment.figures = _figures(canary_ms=300, rest_ms=100, n=60)
    experiment.save()
    rolled = experiments.check_canary(experiment)
    assert rolled is not None and rolled.status == "rolled_back"
    assert "us-east: TTFT +200.0 ms" in rolled.end_note
    assert not live_snapshot(redis_conn, cp_keys).canary
    entry = LogEntry.objects.filter(object_id=str(experiment.pk)).order_by("-action_time").first()
    assert entry.user.username == "gorgo-system" and "Rolled back" in entry.change_message
    shown = operator_client.get(f"{URL}{experiment.pk}/").json()
    assert shown["status"] == "rolled_back" and shown["comparison"][0]["worse"]
