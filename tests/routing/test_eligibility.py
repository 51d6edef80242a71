"""Which nodes are candidates: model, scope, state, health, residency, max RTT."""

from __future__ import annotations

from routing.contract import SCHEMA_VERSION, NodeLiveState, ResidencyRule, RTTEntry, RTTTable
from routing.state.eligibility import (
    RESIDENCY,
    RTT_TOO_HIGH,
    UNHEALTHY,
    allowed_node_regions,
    eligible_nodes,
    rtt_from_region,
    served_models,
)
from tests.routing.support import MODEL, make_node, make_snapshot

OTHER = "Qwen/Qwen2.5-7B-Instruct"


def ids(nodes):
    return [node.id for node in nodes]


class TestEligibility:
    def test_it_keeps_only_nodes_serving_the_model_in_id_order(self):
        snapshot = make_snapshot(
            (make_node(3), make_node(1, models=(OTHER,)), make_node(2, models=(MODEL, OTHER)))
        )
        candidates, excluded = eligible_nodes(snapshot, MODEL, "us-east", {}, {})
        assert ids(candidates) == [2, 3]
        assert excluded == {}  # nodes that never served the model are not "excluded"

    def test_it_drops_draining_and_disabled_nodes(self):
        snapshot = make_snapshot(
            (make_node(1, state="draining"), make_node(2, state="disabled"), make_node(3))
        )
        candidates, excluded = eligible_nodes(snapshot, MODEL, "us-east", {}, {})
        assert ids(candidates) == [3]
        assert excluded == {"draining": 1, "disabled": 1}

    def test_it_drops_unhealthy_nodes_and_assumes_health_without_live_state(self):
        snapshot = make_snapshot((make_node(1), make_node(2), make_node(3)))
        live = {
            1: NodeLiveState(SCHEMA_VERSION, 1, healthy=False, updated_at=0.0),
            2: NodeLiveState(SCHEMA_VERSION, 2, healthy=True, updated_at=0.0),
        }
        candidates, excluded = eligible_nodes(snapshot, MODEL, "us-east", live, {})
        assert ids(candidates) == [2, 3]
        assert excluded == {UNHEALTHY: 1}

    def test_it_applies_the_residency_rule_of_the_gateway_region(self):
        rules = (ResidencyRule("eu-central", ("eu-central",)),)
        snapshot = make_snapshot(
            (make_node(1, region="us-east"), make_node(2, region="eu-central")), residency=rules
        )
        eu, excluded = eligible_nodes(snapshot, MODEL, "eu-central", {}, {})
        assert ids(eu) == [2]
        assert excluded == {RESIDENCY: 1}
        us, _ = eligible_nodes(snapshot, MODEL, "us-east", {}, {})  # no rule for us-east: anywhere
        assert ids(us) == [1, 2]

    def test_it_merges_several_rules_for_one_region(self):
        rules = (ResidencyRule("ap-south", ("ap-south",)), ResidencyRule("ap-south", ("eu-central",)))
        assert allowed_node_regions(make_snapshot(()).policy, "ap-south") is None
        policy = make_snapshot((), residency=rules).policy
        assert allowed_node_regions(policy, "ap-south") == frozenset({"ap-south", "eu-central"})

    def test_it_drops_nodes_beyond_max_rtt_only_when_measured(self):
        snapshot = make_snapshot((make_node(1), make_node(2), make_node(3)), max_rtt_ms=150.0)
        candidates, excluded = eligible_nodes(snapshot, MODEL, "us-east", {}, {1: 235.0, 2: 88.0})
        assert ids(candidates) == [2, 3]  # 3 has no measurement yet: kept
        assert excluded == {RTT_TOO_HIGH: 1}

    def test_it_serves_only_models_in_the_policy_scope(self):
        nodes = (make_node(1, models=(MODEL, OTHER)),)
        assert served_models(make_snapshot(nodes)) == tuple(sorted((MODEL, OTHER)))
        assert served_models(make_snapshot(nodes, model_scope=(OTHER,))) == (OTHER,)

    def test_it_reads_the_rtt_row_of_its_own_region(self):
        table = RTTTable(
            SCHEMA_VERSION,
            0.0,
            (RTTEntry("us-east", 1, 1.5, 0.1, 3, 0.0), RTTEntry("eu-central", 1, 88.0, 1.0, 3, 0.0)),
        )
        assert rtt_from_region(table, "eu-central") == {1: 88.0}
        assert rtt_from_region(None, "eu-central") == {}
