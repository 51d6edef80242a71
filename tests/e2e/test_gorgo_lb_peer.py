"""The gorgo-lb adapter of the routing benchmark (benchmarks/gorgo_lb_peer.py) routes by gorgo-lb.

The adapter runs as a real process in front of two stub nodes whose RTTs (from the config) and
queues (from their /metrics) differ; where the requests land is gorgo-lb's ``route_gorgo`` choice
on those inputs. gorgo-lb comes from the ``test`` extra (PyPI ``gorgo-lb``).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import httpx
import msgspec
import pytest

from simulator.topology import DEFAULT_TOPOLOGY_PATH, load_topology
from tests.conftest import ROOT, ProcessGroup
from tests.support.vllm_stub import StubNode, metrics_text
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

ADAPTER = ROOT / "benchmarks" / "gorgo_lb_peer.py"
FOUR_REGION = ROOT / "simulator" / "topologies" / "four-region-short.toml"


def _peer_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gorgo_lb_peer", ADAPTER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gorgo_lb_peer", module)
    spec.loader.exec_module(module)
    return module


peer = _peer_module()


@pytest.fixture
def stubs() -> Iterator[dict[str, StubNode]]:
    nodes = {name: StubNode(name).start_in_thread() for name in ("far", "near")}
    yield nodes
    for node in nodes.values():
        node.stop_thread()


def _start(processes: ProcessGroup, tmp_path: Path, config: object) -> dict[str, str | dict[str, str]]:
    path = tmp_path / "adapter.json"
    path.write_bytes(msgspec.json.encode(config))
    process = processes.start("adapter", [sys.executable, str(ADAPTER), str(path)], ready_text="READY ")
    line = next(ln for ln in process.log().splitlines() if ln.startswith("READY "))
    return json.loads(line[len("READY ") :])


def _chat(url: str, text: str) -> httpx.Response:
    body = {
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "messages": [{"role": "user", "content": text}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=10.0)


def _config(stubs: dict[str, StubNode], **changes: object) -> object:
    # "far" first: the choice is gorgo-lb's, not the list's order.
    nodes = [peer.NodeTarget("far", stubs["far"].url, 200.0), peer.NodeTarget("near", stubs["near"].url, 1.0)]
    fields = {
        "region": "us-east",
        "policy": "gorgo",
        "nodes": nodes,
        "kv_capacity_tokens": 32_768,
        "prefill_ms_per_token": 0.094,
        "scrape_interval_s": 0.1,
        **changes,
    }
    return peer.AdapterConfig(**fields)


def test_it_routes_by_rtt_then_away_from_a_queue_its_scrape_shows(
    stubs: dict[str, StubNode], processes: ProcessGroup, tmp_path: Path
) -> None:
    url = _start(processes, tmp_path, _config(stubs))["url"]
    for index in range(3):  # distinct prompts: no cache anywhere, no queue: RTT decides
        response = _chat(url, f"question number {index} about the weather")
        assert response.status_code == 200 and "data: [DONE]" in response.text
        assert response.headers["x-gorgo-sim-node"] == "near"
    assert len(stubs["near"].seen) == 3 and stubs["far"].seen == []

    # near's /metrics now shows 50 requests of ~1,000 prompt tokens: ~50k queued tokens outweigh
    # the 199 ms of RTT between the two, so route_gorgo picks far once a scrape has seen it.
    busy = metrics_text(engines={"0": {"running": 40, "waiting": 10, "prompt": 100_000}})
    stubs["near"].metrics = busy + "# TYPE vllm:request_success counter\nvllm:request_success_total 100\n"
    sent = 0

    def moved() -> bool:
        nonlocal sent
        sent += 1
        assert sent <= 100, "never moved to far"
        return _chat(url, f"another question {sent}").headers["x-gorgo-sim-node"] == "far"

    wait_until(moved, 20.0, what="a request routed to far")
    assert _chat(url, "one more question").headers["x-gorgo-sim-node"] == "far"


def test_it_charges_a_central_proxys_far_clients_their_way_there(
    stubs: dict[str, StubNode], processes: ProcessGroup, tmp_path: Path
) -> None:
    """The central deployment answers other regions' clients through a delay proxy of their RTT."""
    config = _config(stubs, client_rtt_ms={"ap-south": 40.0})
    adapters = peer.start_adapters(
        [config],
        ["us-east", "ap-south"],
        tmp_path,
        lambda name, argv, _workdir: processes.start(name, argv),
        lambda proc, ready: wait_until(ready, 30.0, what=f"{proc.name} ready", process=proc.popen),
    )
    assert set(adapters.targets) == {"us-east", "ap-south"}
    assert adapters.targets["us-east"] == adapters.homes["us-east"] != adapters.targets["ap-south"]
    response = _chat(adapters.targets["ap-south"], "hello from far away")
    assert response.status_code == 200 and response.headers["x-gorgo-sim-node"] == "near"
    assert adapters.state()["us-east"]["requests"] == 1


def test_the_central_proxy_runs_where_most_clients_are_else_at_the_fleets_centre() -> None:
    default = load_topology(DEFAULT_TOPOLOGY_PATH)
    # Even clients: eu-central, 88 and 120 ms from the others (us-east: 88 and 235).
    assert peer.central_region(default, None) == "eu-central"
    four = load_topology(FOUR_REGION)
    shares = {"ap-northeast": 0.4, "us-west": 0.2, "eu-west": 0.2, "sa-east": 0.2}
    assert peer.central_region(four, shares) == "ap-northeast"
    fleet_nodes = [
        {
            "name": n.name,
            "region": n.region,
            "region_urls": {r.slug: f"http://{r.slug}" for r in four.regions},
        }
        for n in four.nodes
    ]
    (central,) = peer.adapter_configs(
        "gorgo-lb@central",
        fleet_nodes,
        four,
        shares,
        prefill_tokens_per_s=10_638.0,
        kv_capacity_tokens=32_768,
        seed=1,
    )
    assert central.region == "ap-northeast" and set(central.client_rtt_ms) == {
        "us-west",
        "eu-west",
        "sa-east",
    }
    assert {n.url for n in central.nodes} == {"http://ap-northeast"}  # every node through its own port
    per_region = peer.adapter_configs(
        "gorgo-lb",
        fleet_nodes,
        four,
        shares,
        prefill_tokens_per_s=10_638.0,
        kv_capacity_tokens=32_768,
        seed=1,
    )
    assert [c.region for c in per_region] == [r.slug for r in four.regions]
    assert all(c.client_rtt_ms == {} and not c.tune for c in per_region)


def test_the_report_orders_and_targets_every_variant() -> None:
    spec = importlib.util.spec_from_file_location(
        "routing_quality_report", ROOT / "benchmarks" / "routing_quality_report.py"
    )
    assert spec is not None and spec.loader is not None
    report = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("routing_quality_report", report)  # its dataclasses look themselves up
    spec.loader.exec_module(report)
    assert tuple(peer.VARIANTS) == report.GORGO_LB
