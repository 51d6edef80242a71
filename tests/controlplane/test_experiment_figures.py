"""Shadow and canary figures (issue 23): workers sum the request log per region, once, and roll a worse canary back."""

from __future__ import annotations

import time
import uuid

import pytest

from controlplane.dashboard.signals import experiment_message
from controlplane.policies import experiments, publishing, tasks
from controlplane.policies.models import PolicyExperiment, RoutingPolicy
from routing import contract
from routing.contract import REQUEST_STREAM_FIELD, CostTerms, RequestRecord


@pytest.fixture
def live(fleet, operator) -> RoutingPolicy:
    policy = RoutingPolicy.objects.create(name="live", algorithm="gorgo")
    publishing.publish(policy)
    return policy


def start(operator, kind: str, **options) -> PolicyExperiment:
    candidate = RoutingPolicy.objects.create(
        name=f"candidate-{kind}", algorithm="gorgo", params={"w_rtt": 0.0}
    )
    return experiments.start(
        kind,
        policy=candidate,
        spec=experiments.trial_from_draft(candidate),
        source_version=None,
        user=operator.user,
        **options,
    )


def rec(node, **fields) -> RequestRecord:
    values = {
        "schema_version": contract.SCHEMA_VERSION,
        "request_id": uuid.uuid4().hex,
        "ts": time.time(),
        "gateway_region": "us-east",
        "gateway_id": "gw-1",
        "model": "m",
        "status": 200,
        "stream": True,
        "node_id": node.pk,
        "node_region": node.region.slug,
        "ttft_ms": 100.0,
        "total_ms": 300.0,
    }
    values.update(fields)
    return RequestRecord(**values)


def append(redis_conn, cp_keys, records) -> None:
    for record in records:
        redis_conn.xadd(cp_keys.request_stream, {REQUEST_STREAM_FIELD: contract.encode(record)})


def test_it_sums_what_the_shadow_would_have_done_per_region(live, operator, fleet, redis_conn, cp_keys):
    shadow = start(operator, "shadow")
    use, euc = fleet.nodes["us-east-1"], fleet.nodes["eu-central-1"]
    records = [rec(use, shadow_id=None)]  # before a gateway loaded the shadow: not its record
    for index in range(10):
        # The live policy keeps all ten at home (20 ms predicted); the shadow sends four abroad (90 ms).
        abroad = index < 4
        target = euc if abroad else use
        records.append(
            rec(
                use,
                cost=CostTerms(node_id=use.pk, rtt_ms=2.0, queue_ms=8.0, prefill_ms=10.0),
                shadow_id=shadow.pk,
                shadow_node_id=target.pk,
                shadow_node_region=target.region.slug,
                shadow_cost=CostTerms(node_id=target.pk, rtt_ms=80.0 if abroad else 2.0, prefill_ms=10.0),
            )
        )
    append(redis_conn, cp_keys, records)

    assert tasks.watch_experiments() == {shadow.pk: 10}
    assert tasks.watch_experiments() == {shadow.pk: 0}  # the cursor moved on: nothing counted twice

    shadow.refresh_from_db()
    figures = shadow.figures["regions"]["us-east"]["shadow"]
    assert (figures["requests"], figures["moved_share"]) == (10, 0.4)
    assert (figures["cross_region_share_live"], figures["cross_region_share_shadow"]) == (0.0, 0.4)
    assert figures["live_predicted_p50_ms"] == pytest.approx(20.0, rel=0.03)
    assert figures["shadow_predicted_p99_ms"] == pytest.approx(90.0, rel=0.03)
    message = experiment_message(shadow)
    assert (message["type"], message["kind"], message["comparison"]) == ("policy.experiment", "shadow", [])
    assert message["regions"]["us-east"]["shadow"]["moved_share"] == 0.4
    assert "live_predicted_histogram" not in message["regions"]["us-east"]["shadow"]


def test_it_counts_nothing_twice_when_two_ticks_race(live, operator, fleet, redis_conn, cp_keys):
    from controlplane.policies import experiment_figures

    shadow = start(operator, "shadow")
    use = fleet.nodes["us-east-1"]
    append(
        redis_conn,
        cp_keys,
        [rec(use, shadow_id=shadow.pk, shadow_node_id=use.pk, shadow_node_region="us-east")],
    )
    stale = PolicyExperiment.objects.get(pk=shadow.pk)  # a second worker read the same cursor
    assert experiment_figures.collect(redis_conn, cp_keys, shadow) == 1
    assert experiment_figures.collect(redis_conn, cp_keys, stale) == 0  # its compare-and-swap fails
    shadow.refresh_from_db()
    assert shadow.figures["regions"]["us-east"]["shadow"]["requests"] == 1


def test_it_rolls_back_a_slower_canary_on_the_next_tick(live, operator, fleet, redis_conn, cp_keys):
    canary = start(
        operator, "canary", share_percent=20, limits=experiments.CanaryLimits(margin_ms=50, min_samples=30)
    )
    use = fleet.nodes["us-east-1"]
    records = []
    for index in range(40):
        jitter = (index % 5) * 4.0
        records.append(rec(use, canary_id=canary.pk, arm="live", ttft_ms=100.0 + jitter))
        records.append(rec(use, canary_id=canary.pk, arm="canary", ttft_ms=400.0 + jitter))
    # Client errors are neither requests nor errors of either arm; a 502 is an error of its arm.
    records.append(rec(use, canary_id=canary.pk, arm="canary", status=429, ttft_ms=None))
    records.append(rec(use, canary_id=canary.pk, arm="live", status=502, ttft_ms=None))
    append(redis_conn, cp_keys, records)

    tasks.watch_experiments()

    canary.refresh_from_db()
    arms = canary.figures["regions"]["us-east"]
    assert (arms["canary"]["requests"], arms["canary"]["errors"]) == (40, 0)
    assert (arms["live"]["requests"], arms["live"]["errors"]) == (41, 1)
    assert canary.status == "rolled_back" and "us-east: TTFT +300.0 ms" in canary.end_note
    snapshot = contract.decode(redis_conn.get(cp_keys.policy_current), contract.PolicySnapshot)
    assert not snapshot.canary
    message = experiment_message(canary)
    assert message["status"] == "rolled_back" and message["comparison"][0]["worse"]


def test_a_shadow_that_chose_the_live_node_is_counted_with_the_live_terms() -> None:
    """The gateway leaves ``shadow_cost`` out when the shadow chose the live node and priced it as
    the live side (``RequestRecord.shadow_terms``): the figures still count the shadow's prediction."""
    from controlplane.policies.experiment_figures import add_records

    def record(node_id: int, shadow_node_id: int, shadow_cost: CostTerms | None) -> RequestRecord:
        return RequestRecord(
            schema_version=contract.SCHEMA_VERSION,
            request_id=uuid.uuid4().hex,
            ts=time.time(),
            gateway_region="us-east",
            gateway_id="gw-1",
            model="m",
            status=200,
            stream=False,
            node_id=node_id,
            node_region="us-east",
            cost=CostTerms(node_id=node_id, rtt_ms=2.0, queue_ms=8.0, prefill_ms=10.0),
            shadow_id=7,
            shadow_node_id=shadow_node_id,
            shadow_node_region="us-east",
            shadow_cost=shadow_cost,
        )

    same = [record(1, 1, None) for _ in range(6)]  # logged once: the shadow's terms are the live ones
    elsewhere = [record(1, 2, CostTerms(node_id=2, rtt_ms=2.0, prefill_ms=68.0)) for _ in range(4)]
    figures: dict = {}
    add_records(figures, 7, same + elsewhere)
    shadow = figures["regions"]["us-east"]["shadow"]
    assert (shadow["requests"], shadow["moved_share"]) == (10, 0.4)
    assert sum(shadow["shadow_predicted_histogram"].values()) == 10  # none lost for want of terms
    assert shadow["shadow_predicted_p50_ms"] == pytest.approx(20.0, rel=0.03)
    assert same[0].shadow_terms == same[0].cost and elsewhere[0].shadow_terms == elsewhere[0].shadow_cost


def test_a_canary_whose_clients_hang_up_before_any_token_is_worse() -> None:
    """A client that gave up before its first token (499) was left out with the other client errors:
    a canary that made three clients in four wait until they hung up looked as good as the live
    policy (its slowest requests gone from its TTFT, no error counted)."""
    from controlplane.policies.canary_stats import ArmSums, compare
    from controlplane.policies.experiment_figures import add_records

    def record(arm: str, status: int = 200, ttft_ms: float | None = 100.0) -> RequestRecord:
        return RequestRecord(
            schema_version=contract.SCHEMA_VERSION,
            request_id=uuid.uuid4().hex,
            ts=time.time(),
            gateway_region="us-east",
            gateway_id="gw-1",
            model="m",
            status=status,
            stream=True,
            node_id=1,
            node_region="us-east",
            ttft_ms=ttft_ms,
            canary_id=7,
            arm=arm,
        )

    records = [record("live") for _ in range(1000)] + [record("canary") for _ in range(250)]
    records += [record("canary", status=499, ttft_ms=None) for _ in range(750)]  # waited, then left
    records += [
        record("canary", status=400, ttft_ms=None) for _ in range(50)
    ]  # a bad request: not the policy's
    figures: dict = {}
    add_records(figures, 7, records)
    arms = figures["regions"]["us-east"]
    canary, rest = ArmSums.from_json(arms["canary"]), ArmSums.from_json(arms["live"])
    assert (canary.requests, canary.errors) == (1000, 750)
    verdict = compare(
        "us-east", canary, rest, margin_ms=50, margin_error_rate=0.02, min_samples=200, alpha=0.05
    )
    assert verdict.worse is not None and "error" in verdict.worse
