"""The routing benchmark reuses one emulated fleet between runs (benchmarks/routing_quality.py's
``Fleets``): each run must find it as a new process starts it, with nothing of the run before.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import httpx
import pytest

from simulator.topology import DEFAULT_TOPOLOGY_PATH
from tests.conftest import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def _harness() -> ModuleType:
    sys.path.insert(0, str(ROOT / "benchmarks"))  # the benchmark imports its siblings by name
    spec = importlib.util.spec_from_file_location(
        "routing_quality", ROOT / "benchmarks" / "routing_quality.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("routing_quality", module)
    spec.loader.exec_module(module)
    return module


rq = _harness()


def _cached_tokens(url: str, text: str) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 2}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30.0)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _counter(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_it_resets_the_same_fleet_process_before_each_run(tmp_path: Path) -> None:
    fleets = rq.Fleets(tmp_path)
    try:
        first = fleets.ready(DEFAULT_TOPOLOGY_PATH)
        url = first.nodes[0]["url"]
        prompt = "What does the policy manual say about refunds? " * 80
        _cached_tokens(url, prompt)
        assert _cached_tokens(url, prompt) > 0  # the node holds the prompt now
        assert httpx.get(f"{first.control_url}/oracle", timeout=10.0).json()["requests"]

        second = fleets.ready(DEFAULT_TOPOLOGY_PATH)
        assert second.proc.popen.pid == first.proc.popen.pid  # no new process ...
        assert [n["url"] for n in second.nodes] == [n["url"] for n in first.nodes]  # ... same ports
        assert httpx.get(f"{second.control_url}/oracle", timeout=10.0).json() == {
            "requests": {},
            "served": {},
        }
        for node in second.nodes:
            assert _counter(node["url"], "vllm:prefix_cache_queries_total") == 0
        assert _cached_tokens(url, prompt) == 0  # ... and nothing cached from the run before

        first.proc.stop()  # a fleet that died is replaced by a new one
        third = fleets.ready(DEFAULT_TOPOLOGY_PATH)
        assert third.proc.popen.pid != first.proc.popen.pid
        assert _cached_tokens(third.nodes[0]["url"], prompt) == 0
    finally:
        fleets.stop()
