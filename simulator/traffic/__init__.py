"""Open-loop traffic generator for gateways or emulated nodes (``python -m simulator.traffic``).

Programmatic use (benchmarks)::

    plan = build_plan("geo-chat", ["us-east", "eu-central", "ap-south"],
                      rate_rps=5, duration_s=60, max_requests=300, seed=1)
    results = await run_plan(plan, {"us-east": "http://127.0.0.1:9001", ...})
    print(format_summary(summarize(results)))

The same seed gives the same arrivals, so every routing policy sees identical traffic.
"""

from __future__ import annotations

from simulator.traffic.report import RegionSummary, format_summary, percentile, summarize
from simulator.traffic.runner import RequestResult, run_plan
from simulator.traffic.workloads import WORKLOADS, Arrival, WorkloadPlan, build_plan

__all__ = [
    "WORKLOADS",
    "Arrival",
    "RegionSummary",
    "RequestResult",
    "WorkloadPlan",
    "build_plan",
    "format_summary",
    "percentile",
    "run_plan",
    "summarize",
]
