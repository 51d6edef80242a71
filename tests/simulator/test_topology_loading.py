"""Topology files: the shipped demo fleet, the RTT matrix, and clear errors for bad files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from simulator.topology import DEFAULT_TOPOLOGY_PATH, EngineParams, TopologyError, load_topology
from tests.conftest import ROOT

VALID = """
[fleet]
name = "t"
[network]
intra_region_rtt_ms = 1.0
[[network.links]]
a = "x"
b = "y"
rtt_ms = 50.0
[[regions]]
slug = "x"
latitude = 1.0
longitude = 2.0
[[regions]]
slug = "y"
latitude = 3.0
longitude = 4.0
[[nodes]]
name = "x-1"
region = "x"
port = 9001
[nodes.engine]
max_num_seqs = 8
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "topology.toml"
    path.write_text(text)
    return path


def test_it_ships_the_demo_fleet() -> None:
    topology = load_topology(DEFAULT_TOPOLOGY_PATH)
    assert [(n.name, n.region, n.port) for n in topology.nodes] == [
        ("us-east-1", "us-east", 8101),
        ("us-east-2", "us-east", 8102),
        ("eu-central-1", "eu-central", 8103),
        ("eu-central-2", "eu-central", 8104),
        ("ap-south-1", "ap-south", 8105),
        ("ap-south-2", "ap-south", 8106),
    ]
    assert {n.model for n in topology.nodes} == {"meta-llama/Llama-3.1-8B-Instruct"}
    assert topology.node("us-east-1").url == "http://127.0.0.1:8101"
    ashburn = topology.region("us-east")
    assert (ashburn.latitude, ashburn.longitude) == (39.04, -77.49)
    assert topology.rtt_ms("us-east", "eu-central") == topology.rtt_ms("eu-central", "us-east") == 88.0
    assert topology.rtt_ms("us-east", "ap-south") == 235.0
    assert topology.rtt_ms("eu-central", "ap-south") == 120.0
    assert topology.rtt_ms("ap-south", "ap-south") == 1.5
    engine = topology.node("eu-central-2").engine
    assert engine.block_size == 16
    assert engine.max_model_len == 32768
    assert engine.kv_capacity_tokens >= engine.max_model_len


def test_it_applies_per_node_engine_overrides_over_the_defaults(tmp_path: Path) -> None:
    topology = load_topology(write(tmp_path, VALID))
    assert topology.node("x-1").engine == EngineParams(max_num_seqs=8)
    assert topology.rtt_ms("y", "x") == 50.0
    with pytest.raises(KeyError):
        topology.rtt_ms("x", "z")


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (("max_num_seqs = 8", "max_num_sequences = 8"), "max_num_sequences"),
        (('region = "x"', 'region = "z"'), "'z'"),
        (("rtt_ms = 50.0", "rtt_ms = -5.0"), "rtt_ms"),
        (('b = "y"', 'b = "x"'), "itself"),
        (("max_num_seqs = 8", "max_model_len = 999999"), "kv_capacity_blocks"),
        (("port = 9001", 'port = "high"'), "port"),
        (("[fleet]", "[fleet]\ncolour = 1"), "colour"),
    ],
)
def test_it_rejects_bad_files_naming_the_problem(
    tmp_path: Path, change: tuple[str, str], expected: str
) -> None:
    with pytest.raises(TopologyError, match=expected.replace("(", r"\(")):
        load_topology(write(tmp_path, VALID.replace(*change)))


def test_it_requires_an_rtt_for_every_pair_of_regions(tmp_path: Path) -> None:
    text = VALID + '[[regions]]\nslug = "w"\nlatitude = 0.0\nlongitude = 0.0\n'
    with pytest.raises(TopologyError, match="x <-> w"):
        load_topology(write(tmp_path, text))


def test_it_imports_without_starting_anything() -> None:
    # seed_demo imports the topology module inside Django: it must not pull in the servers.
    code = "import sys, simulator.topology; print(sorted(m for m in ('aiohttp', 'simulator.server') if m in sys.modules))"
    completed = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert completed.stdout.strip() == "[]", completed.stderr


def test_new_fleet_defaults_leave_a_nodes_own_engine_entries_alone(tmp_path: Path) -> None:
    """A benchmark sets the fleet's engine; a node that sets its own (a slower GPU) keeps it."""
    node = load_topology(write(tmp_path, VALID)).node("x-1")  # sets max_num_seqs = 8 itself
    engine = node.engine_under({"max_num_seqs": 64, "prefill_tokens_per_s": 5_000.0})
    assert (engine.max_num_seqs, engine.prefill_tokens_per_s) == (8, 5_000.0)
    assert node.engine_under(None) == node.engine


def test_the_mixed_gpu_fleet_keeps_its_slow_nodes_under_any_defaults() -> None:
    topology = load_topology(ROOT / "simulator" / "topologies" / "mixed-gpus.toml")
    for defaults in (None, {"prefill_tokens_per_s": 10_000.0, "kv_capacity_blocks": 2048}):
        engines = {n.name: n.engine_under(defaults) for n in topology.nodes}
        fast = 10_000.0 if defaults else 20_000.0
        assert {name: e.prefill_tokens_per_s for name, e in engines.items()} == {
            "us-east-1": fast,
            "us-east-2": fast,
            "eu-central-1": fast,
            "eu-central-2": 5_319.0,
            "ap-south-1": 5_319.0,
            "ap-south-2": 5_319.0,
        }
        assert engines["ap-south-1"].kv_capacity_tokens == 1024 * 16


def test_the_fleet_takes_new_defaults_under_each_nodes_own_and_overrides_over_all() -> None:
    from simulator.fleet import Fleet

    topology = load_topology(ROOT / "simulator" / "topologies" / "mixed-gpus.toml")
    fleet = Fleet(
        topology,
        auto_ports=True,
        only=["us-east-1", "ap-south-1"],
        engine_defaults={"prefill_tokens_per_s": 10_000.0},
        engine_overrides={"max_num_seqs": 16},
    )
    fast, slow = fleet.nodes["us-east-1"].params, fleet.nodes["ap-south-1"].params
    assert (fast.prefill_tokens_per_s, slow.prefill_tokens_per_s) == (10_000.0, 5_319.0)
    assert fast.max_num_seqs == slow.max_num_seqs == 16  # --engine still sets every node's
