"""The routing-quality report's percentiles count failed requests (benchmarks/routing_quality_report.py).

A policy that fails a region's requests during an outage must not drop its slowest requests from
its own percentiles: a measured request that got no first token counts as TTFT = +inf.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from routing.contract import RequestRecord
from simulator.traffic.runner import RequestResult
from tests.conftest import ROOT

NODE_REGIONS = {"us-east-1": "us-east", "eu-central-1": "eu-central"}


def _report() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "routing_quality_report", ROOT / "benchmarks" / "routing_quality_report.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("routing_quality_report", module)  # its dataclasses look themselves up
    spec.loader.exec_module(module)
    return module


report = _report()


@dataclass
class Output:
    results: list[RequestResult]
    warmup_requests: int = 0
    node_counters: dict[str, dict[str, float]] = field(default_factory=dict)
    node_regions: dict[str, str] = field(default_factory=lambda: dict(NODE_REGIONS))
    arrival_window_s: float = 10.0
    records: list[RequestRecord] = field(default_factory=list)
    oracle_ms: dict[int, float] = field(default_factory=dict)
    peer_state: dict[str, Any] | None = None
    served: dict[int, Any] = field(default_factory=dict)


def answered(
    index: int,
    region: str,
    node: str | None,
    ttft_ms: float | None,
    error: str | None = None,
    status: int = 200,
) -> RequestResult:
    return RequestResult(
        index=index,
        client_region=region,
        conversation_id=f"c{index}",
        turn=0,
        target="http://gw",
        scheduled_s=index * 0.1,
        sent_s=index * 0.1,
        status=status,
        ttft_ms=ttft_ms,
        node=node,
        error=error,
    )


def failed(index: int, region: str) -> RequestResult:
    return answered(index, region, None, None, "No available workers", status=503)


def outage_run(*, fail_the_failover: bool) -> Any:
    """us-east: 4 requests home (40 ms), 5 during its outage (abroad at 300 ms, or failed)."""
    results = [answered(i, "us-east", "us-east-1", 40.0) for i in range(4)]
    for i in range(4, 9):
        results.append(
            failed(i, "us-east") if fail_the_failover else answered(i, "us-east", "eu-central-1", 300.0)
        )
    results += [answered(i, "eu-central", "eu-central-1", 35.0) for i in range(9, 12)]
    return report.summarize_run(Output(results), 10_000.0)


def test_it_does_not_reward_failing_the_slow_requests() -> None:
    served = outage_run(fail_the_failover=False)
    failing = outage_run(fail_the_failover=True)
    # Successful-only percentiles gave the failing policy 40 ms against 300 ms (us-east) and
    # 37.5 ms against 40 ms overall: it looked better for failing its clients.
    assert served.by_region["us-east"].ttft_p50_ms == 300.0
    assert failing.by_region["us-east"].ttft_p50_ms == math.inf
    assert failing.ttft_p50_ms >= served.ttft_p50_ms
    assert failing.errors == 5 and failing.by_region["us-east"].errors == 5
    assert served.errors == 0


def test_it_keeps_the_ttft_of_a_request_cut_off_after_its_first_token() -> None:
    results = [answered(0, "us-east", "us-east-1", 50.0, error="The node stopped mid-stream")]
    results += [answered(i, "us-east", "us-east-1", 60.0) for i in range(1, 3)]
    figures = report.summarize_run(Output(results), 10_000.0)
    assert figures.errors == 1
    assert figures.ttft_p50_ms == 60.0
    assert figures.ttfts_ms == [50.0, 60.0, 60.0]


def test_a_percentile_next_to_a_failure_is_infinite_and_before_it_exact() -> None:
    values = [10.0, 20.0, 30.0, math.inf]
    assert report.ttft_percentile(values, 50) == 25.0  # between 20 and 30
    assert report.ttft_percentile(values, 99) == math.inf
    assert report.ttft_percentile([math.inf, math.inf], 50) == math.inf
    assert report.ttft_percentile([], 50) is None


def test_the_json_writes_an_infinite_percentile_as_null(tmp_path: Path) -> None:
    served = outage_run(fail_the_failover=False)
    failing = outage_run(fail_the_failover=True)
    meta = {
        "command": "test",
        "date": "today",
        "machine": "here",
        "duration_s": 1.0,
        "requests_per_run": 12,
        "seeds": [1],
        "max_tokens": 128,
        "rates_rps": {"region-outage": 1.0},
    }
    runs = {"region-outage": {"vllm-router@local": [failing], "gorgo": [served]}}
    report.write_outputs(tmp_path / "out", meta, runs)
    document = json.loads((tmp_path / "out.json").read_text())  # strict: no Infinity
    figures = document["workloads"]["region-outage"]["policies"]["vllm-router@local"][0]
    assert figures["by_region"]["us-east"]["ttft_p50_ms"] is None
    assert figures["errors"] == 5
    us_east = next(t for t in document["targets"] if t["target"].startswith("us-east"))
    assert us_east["met"] is True  # 300 ms against a regional baseline that failed them
    markdown = (tmp_path / "out.md").read_text()
    assert "counts as TTFT = inf" in markdown
    assert "| vllm-router@local | inf (0%) | 35 (0%) |" in markdown  # was 40: its survivors only


def test_it_splits_each_requests_ttft_and_its_gap_to_the_bound() -> None:
    # Issue 24: where the gap to the oracle bound goes, per request. The terms add up to what the
    # client measured; the bound has no intake, queue or lag; failures have no split.
    results = [answered(i, "us-east", "us-east-1", ttft) for i, ttft in enumerate((40.0, 50.0, 60.0, 400.0))]
    results.append(failed(4, "us-east"))
    served = {
        i: report.Served(
            rtt_ms=2.0,
            intake_ms=1.0,
            queue_ms=queue,
            prefill_ms=20.0,
            lag_ms=0.5,
            bound_rtt_ms=2.0,
            bound_compute_ms=15.0,
        )
        for i, queue in enumerate((5.0, 10.0, 20.0, 300.0))
    }
    figures = report.summarize_run(Output(results, served=served), 10_000.0)
    split = figures.attribution
    assert split is not None and split["requests"] == 4
    mean = split["mean"]
    assert mean["ttft_ms"] == 137.5 and mean["queue_ms"] == 83.75
    assert sum(mean[f"{term}_ms"] for term in report.TERMS) == 137.5
    assert mean["bound_ms"] == 17.0
    assert sum(mean[f"gap_{term}_ms"] for term in report.TERMS) == 137.5 - 17.0
    assert (mean["gap_rtt_ms"], mean["gap_prefill_ms"], mean["gap_queue_ms"]) == (0.0, 5.0, 83.75)
    # At the median (the 45th to 55th percentile of TTFT): the 50 and 60 ms requests.
    band = split["median_band"]
    assert band["ttft_ms"] == 55.0 and band["queue_ms"] == 15.0
    assert band["other_ms"] == 55.0 - 2.0 - 1.0 - 15.0 - 20.0 - 0.5
