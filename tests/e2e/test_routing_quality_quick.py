"""The routing-quality benchmark's smoke run: real fleet, gateways and traffic; the JSON's shape.

Runs ``benchmarks/routing_quality.py --quick`` on one workload with two policies (the full
benchmark takes ~15 minutes and is not a test). Checks the output's contract, not its speed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

FIGURES = (
    "ttft_p50_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
    "requests",
    "errors",
    "prefix_hit_rate",
    "cross_region_share",
)


def test_it_writes_figures_per_policy_and_client_region(tmp_path: Path, redis_url: str) -> None:
    out = tmp_path / "rq"
    result = subprocess.run(
        [
            *(sys.executable, "benchmarks/routing_quality.py", "--quick", "--workloads", "geo-chat"),
            *("--policies", "least_load,gorgo", "--out", str(out)),
        ],
        cwd=ROOT,
        env={**os.environ, "REDIS_URL": redis_url},
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads(out.with_suffix(".json").read_text())
    policies = document["workloads"]["geo-chat"]["policies"]
    assert set(policies) == {"least_load", "gorgo"}
    for name, figures in policies.items():
        for key in FIGURES:
            assert isinstance(figures[key], int | float), (name, key)
        assert figures["requests"] == 150 and figures["errors"] == 0
        assert 0 < figures["ttft_p50_ms"] <= figures["ttft_p90_ms"] <= figures["ttft_p99_ms"]
        assert 0 <= figures["prefix_hit_rate"] <= 1 and 0 <= figures["cross_region_share"] <= 1
        assert set(figures["by_region"]) == {"us-east", "eu-central", "ap-south"}
        assert sum(region["requests"] for region in figures["by_region"].values()) == 150
        gateway = figures["gateway"]
        # Every request of the run (warm-up included) was logged, none as a client disconnect.
        assert gateway["records"] == figures["requests"] + figures["warmup_requests"]
        assert gateway["status_499"] == 0
    # Through real gateway processes the gorgo records carry the index's matches.
    assert policies["gorgo"]["gateway"]["records_with_matched_tokens"] > 0
    assert policies["least_load"]["gateway"]["records_with_matched_tokens"] == 0
    assert {target["target"] for target in document["targets"]} == {
        "p50 <= 0.8x the best other",
        "p99 <= 0.9x the best other",
    }
    markdown = out.with_suffix(".md").read_text()
    assert "## geo-chat" in markdown and "| **gorgo** |" in markdown
    assert out.with_suffix(".png").stat().st_size > 10_000
