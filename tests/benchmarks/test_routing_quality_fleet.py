"""The routing benchmark runs the topology it is given: a fleet of mixed GPUs stays mixed (its
slow nodes are emulated slow and registered slow), and its load is set per node at the paper's
speed, so slower nodes get proportionally less."""

from __future__ import annotations

import sys

import pytest

from simulator.topology import DEFAULT_TOPOLOGY_PATH, load_topology
from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))  # the benchmarks import each other by name
import routing_quality as rq

MIXED = ROOT / "simulator" / "topologies" / "mixed-gpus.toml"


def _fleet(topology: rq.Topology) -> rq.FleetProc:
    nodes = [
        {"name": n.name, "region": n.region, "url": f"http://127.0.0.1:{9000 + i}", "region_urls": {}}
        for i, n in enumerate(topology.nodes)
    ]
    return rq.FleetProc(proc=None, nodes=nodes, control_url="")  # type: ignore[arg-type]


def test_the_policy_is_told_each_nodes_own_speed_and_cache() -> None:
    topology = load_topology(MIXED)
    specs = {n.name: n for n in rq.node_specs(topology, _fleet(topology))}
    assert specs["us-east-1"].prefill_tokens_per_s == rq.PREFILL_TOKENS_PER_S  # the benchmark's default
    assert specs["ap-south-1"].prefill_tokens_per_s == 5_319.0  # the node's own, an A100
    assert specs["us-east-1"].kv_capacity_tokens == rq.KV_CAPACITY_BLOCKS * 16
    assert specs["ap-south-1"].kv_capacity_tokens == 1024 * 16
    told_half = {n.name: n for n in rq.node_specs(topology, _fleet(topology), told_prefill_scale=0.5)}
    assert told_half["ap-south-1"].prefill_tokens_per_s == 5_319.0 * 0.5  # wrong inputs, per node


def test_the_load_is_per_node_at_the_papers_speed() -> None:
    default, mixed = load_topology(DEFAULT_TOPOLOGY_PATH), load_topology(MIXED)
    assert rq.fleet_prefill_tokens_per_s(default) == rq.PREFILL_TOKENS_PER_S
    geo_chat = rq.SCENARIOS["geo-chat"]
    # three of six nodes at half speed: the fleet is worth 4.5 of the default's nodes
    assert rq.scenario_rate(geo_chat, mixed) == round(rq.scenario_rate(geo_chat, default) * 4.5 / 6, 1)


def test_the_report_names_each_nodes_engine_when_they_differ() -> None:
    from routing_quality_report import _fleet_lines

    fleet = {
        "topology": "t.toml",
        "regions": {"us-east": {"nodes": 1, "client_share": 1.0}},
        "rtt_ms": {},
        "prefill_tokens_per_s_per_node": {"us-east-1": 10_638.3, "ap-south-1": 5_319.0},
        "kv_capacity_tokens": 32_768,
    }
    line = _fleet_lines(fleet)[0]
    assert "us-east-1 10,638 / 32,768, ap-south-1 5,319 / 32,768" in line


def test_the_event_model_replays_the_same_mixed_fleet() -> None:
    import routing_quality_events as events

    from routing.contract import GorgoParams

    snapshot = events.snapshot_of(load_topology(MIXED), GorgoParams())
    speeds = {node.name: node.prefill_tokens_per_s for node in snapshot.nodes}
    assert speeds["eu-central-1"] == rq.PREFILL_TOKENS_PER_S and speeds["eu-central-2"] == 5_319.0
    outcome = events.run("geo-chat", "gorgo", 1, 20, {}, topology_path=MIXED)
    assert set(outcome["region_p50_ms"]) == {"us-east", "eu-central", "ap-south"}


def test_a_longer_warm_up_is_asked_for_by_arrivals_and_a_negative_one_refused() -> None:
    args = rq.parse_args(["--workloads", "geo-chat", "--warmup", "1200"])
    assert args.warmup == 1200
    spec = rq.RunSpec(rq.SCENARIOS["geo-chat"], "gorgo", 42.0, 320, warmup_requests=args.warmup)
    assert rq.warmup_of(spec) == 1200
    assert rq.warmup_of(rq.RunSpec(rq.SCENARIOS["geo-chat"], "gorgo", 42.0, 320)) == 32  # 10 % by default
    with pytest.raises(SystemExit):
        rq.parse_args(["--warmup", "-5"])
