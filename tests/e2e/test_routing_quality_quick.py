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

TERMS = ("rtt", "intake", "queue", "prefill", "lag", "other")  # routing_quality_report.TERMS
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
    """Any topology file and client mix: the fleet that ran is the one the report describes."""
    out = tmp_path / "rq"
    shares = "ap-northeast=0.4,us-west=0.2,eu-west=0.2,sa-east=0.2"
    result = subprocess.run(
        [
            *(sys.executable, "benchmarks/routing_quality.py", "--quick", "--workloads", "geo-chat"),
            *("--policies", "prefix_affinity@local,gorgo", "--out", str(out)),
            *("--topology", "simulator/topologies/four-region-short.toml", "--client-share", shares),
        ],
        cwd=ROOT,
        env={**os.environ, "REDIS_URL": redis_url},
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads(out.with_suffix(".json").read_text())
    workload = document["workloads"]["geo-chat"]
    fleet = workload["fleet"]
    assert fleet["topology"] == "simulator/topologies/four-region-short.toml"
    assert {r: (v["nodes"], v["client_share"]) for r, v in fleet["regions"].items()} == {
        "us-west": (2, 0.2),
        "eu-west": (2, 0.2),
        "ap-northeast": (1, 0.4),
        "sa-east": (2, 0.2),
    }
    assert workload["rate_rps"] == 49.0  # 7 requests/s per node
    policies = workload["policies"]
    assert set(policies) == {"prefix_affinity@local", "gorgo"}
    for name, seeds in policies.items():
        (figures,) = seeds  # --quick: one seed
        for key in FIGURES:
            assert isinstance(figures[key], int | float), (name, key)
        assert figures["requests"] == 150 and figures["errors"] == 0
        assert 0 < figures["ttft_p50_ms"] <= figures["ttft_p90_ms"] <= figures["ttft_p99_ms"]
        assert 0 <= figures["prefix_hit_rate"] <= 1 and 0 <= figures["cross_region_share"] <= 1
        assert set(figures["by_region"]) == set(fleet["regions"])
        assert sum(region["requests"] for region in figures["by_region"].values()) == 150
        # The oracle bound: at least the intra-region RTT, never more than what was measured.
        assert 1.5 <= figures["oracle_p50_ms"] <= figures["ttft_p50_ms"]
        # Where the time goes: per request the terms add up to the TTFT the client measured, and
        # the gap to the bound adds up to TTFT minus bound (issue 24: attribute the gap).
        attribution = figures["attribution"]
        assert attribution["requests"] == 150
        for part in ("mean", "median_band"):
            terms = attribution[part]
            assert sum(terms[f"{t}_ms"] for t in TERMS) == pytest.approx(terms["ttft_ms"], abs=0.5)
            gap = sum(terms[f"gap_{t}_ms"] for t in TERMS)
            assert gap == pytest.approx(terms["ttft_ms"] - terms["bound_ms"], abs=0.5)
            assert (
                min(terms["intake_ms"], terms["queue_ms"], terms["lag_ms"]) >= 0 and terms["prefill_ms"] > 0
            )
            assert terms["rtt_ms"] >= 1.5
        gateway = figures["gateway"]
        # Every request of the run (warm-up included) was logged, none as a client disconnect.
        assert gateway["records"] == figures["requests"] + figures["warmup_requests"]
        assert gateway["status_499"] == 0
        # Where the run's wall clock went (issue 24: the committed run within ~30 minutes).
        phases = figures["phases_s"]
        assert {"fleet_reset", "routers_start", "arrivals", "to_last_first_token", "teardown"} <= set(phases)
        assert phases["arrivals"] > 0 and isinstance(figures["cut_after_first_token"], int)
    # The regional baseline never leaves the client's region while it has a healthy node.
    assert policies["prefix_affinity@local"][0]["cross_region_share"] == 0
    # Issue 24's criteria: against every other policy that ran, and each region's own clients.
    assert {target["target"] for target in document["targets"]} == {
        "p50 <= 1x every other policy's",
        "p99 <= 1.05x every other policy's",
        "p50 vs the oracle bound (<= 1.5x on geo-chat)",
        *(f"{region} clients' p50 <= 1.05x the regional baseline" for region in fleet["regions"]),
    }
    assert document["meta"]["harness"]["fleet"].startswith("one process per topology")
    markdown = out.with_suffix(".md").read_text()
    assert "## geo-chat" in markdown and "| **gorgo** |" in markdown
    assert "ap-northeast 1 node / 40% of clients" in markdown and "Displacement" in markdown
    assert "Where the time goes" in markdown
    assert out.with_suffix(".png").stat().st_size > 10_000


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--client-share", "ap-south"), "--client-share expects REGION=SHARE, got 'ap-south'"),
        (("--client-share", "mars=1"), "client shares for unknown region(s) ['mars']"),
        (("--topology", "no/such/file.toml"), "no/such/file.toml"),
    ],
)
def test_it_refuses_a_bad_fleet_description_before_starting_anything(
    flags: tuple[str, str], message: str, redis_url: str
) -> None:
    result = subprocess.run(
        [sys.executable, "benchmarks/routing_quality.py", "--quick", "--workloads", "geo-chat", *flags],
        cwd=ROOT,
        env={**os.environ, "REDIS_URL": redis_url},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert message in result.stderr


def test_it_writes_one_report_per_workload_as_the_committed_run_does(tmp_path: Path, redis_url: str) -> None:
    """Without --out (the committed run) or with --out-dir: DIR/<workload>.{json,md}, each of its own."""
    result = subprocess.run(
        [
            *(
                sys.executable,
                "benchmarks/routing_quality.py",
                "--quick",
                "--workloads",
                "geo-chat,mixed-length",
            ),
            *("--policies", "gorgo", "--requests", "20", "--out-dir", str(tmp_path)),
        ],
        cwd=ROOT,
        env={**os.environ, "REDIS_URL": redis_url},
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for workload in ("geo-chat", "mixed-length"):
        document = json.loads((tmp_path / f"{workload}.json").read_text())
        assert set(document["workloads"]) == {workload}
        assert set(document["meta"]["rates_rps"]) == {workload}
        assert document["meta"]["duration_s"] > 0
        (figures,) = document["workloads"][workload]["policies"]["gorgo"]
        assert figures["requests"] == 20 and figures["errors"] == 0
        assert f"## Run time: {workload}" in (tmp_path / f"{workload}.md").read_text()
    assert not (tmp_path / "four-region.json").exists()
