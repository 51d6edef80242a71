"""region-outage by phase: what each region's clients saw before, during and after the outage.

Reads the per-request output of a routing-quality run (``routing_quality.py --raw DIR``) and prints
a markdown table: per policy and client region, the TTFT p50 (a request with no first token counts
as inf, as in the report), how many requests got no first token, and the share answered abroad,
for four phases of the run:

- before: sent before the outage region's nodes stopped;
- down: the outage's first ``DETECTION_S`` (the routers do not know yet);
- outage: the rest of the outage and ``DETECTION_S`` after it (they do not know it ended);
- after: from then on.

    python benchmarks/routing_quality.py --workloads region-outage --raw var/rq/raw --out var/rq/region-outage
    python benchmarks/routing_quality_phases.py var/rq/raw --policies vllm-router@local,prefix_affinity@local,gorgo

The outage's times come from the plan, rebuilt from the seed in each file's name with the run's
parameters (``--requests`` and ``--rate`` when the run changed them).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict
from pathlib import Path

import msgspec
from routing_quality import (  # this directory is on sys.path
    DETECTION_S,
    MAX_TOKENS,
    REQUESTS_PER_RUN,
    SCENARIOS,
    WARMUP_SHARE,
    scenario_rate,
)
from routing_quality_report import measured_ttft_ms, ttft_percentile

from simulator.topology import load_topology
from simulator.traffic.runner import RequestResult
from simulator.traffic.workloads import build_plan

PHASES = ("before", "down", "outage", "after")


def phase_of(sent_s: float, start_s: float, end_s: float) -> str:
    if sent_s < start_s:
        return "before"
    if sent_s < start_s + DETECTION_S:
        return "down"
    if sent_s < end_s + DETECTION_S:
        return "outage"
    return "after"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("raw", type=Path, help="the --raw directory of a routing_quality.py run")
    parser.add_argument("--workload", default="region-outage")
    parser.add_argument("--policies", default=None, help="comma-separated (default: every policy found)")
    parser.add_argument("--requests", type=int, default=REQUESTS_PER_RUN, help="measured requests per run")
    parser.add_argument("--rate", type=float, default=None, help="the run's --rate, if it had one")
    args = parser.parse_args(argv)
    scenario = SCENARIOS[args.workload]
    topology = load_topology(scenario.topology_path)
    regions = [region.slug for region in topology.regions]
    rate = args.rate or scenario_rate(scenario, topology)
    warmup = round(args.requests * WARMUP_SHARE)
    wanted = args.policies.split(",") if args.policies else None
    cells: dict[tuple[str, str, str], list[RequestResult]] = defaultdict(list)
    policies: list[str] = []
    prefix = f"{args.workload}-"
    for path in sorted(args.raw.glob(f"{prefix}*.jsonl")):
        if path.name.endswith(".records.jsonl"):
            continue
        policy, _, seed = path.stem[len(prefix) :].rpartition("-")
        if wanted is not None and policy not in wanted:
            continue
        plan = build_plan(
            scenario.workload,
            regions,
            rate_rps=rate,
            duration_s=(args.requests + warmup) / rate * 1.5,
            max_requests=args.requests + warmup,
            seed=int(seed),
            max_tokens=MAX_TOKENS,
            client_shares=scenario.client_shares,
        )
        if not plan.outages:
            raise SystemExit(f"{args.workload} has no outage")
        outage = plan.outages[0]
        if policy not in policies:
            policies.append(policy)
        for line in path.read_bytes().splitlines():
            result = msgspec.json.decode(line, type=RequestResult)
            if result.index < warmup:
                continue
            sent_s = result.sent_s if result.sent_s is not None else result.scheduled_s
            phase = phase_of(sent_s, outage.start_s, outage.end_s)
            cells[(policy, result.client_region, phase)].append(result)
    print("| policy | clients | " + " | ".join(PHASES) + " |")
    print("|---|---|" + "---:|" * len(PHASES))
    for policy in wanted or policies:
        for region in regions:
            row = []
            for phase in PHASES:
                results = cells.get((policy, region, phase), [])
                if not results:
                    row.append("-")
                    continue
                p50 = ttft_percentile([measured_ttft_ms(r) for r in results], 50)
                no_token = sum(1 for r in results if r.ttft_ms is None)
                placed = [r for r in results if r.node]
                abroad = sum(1 for r in placed if not r.node.startswith(f"{region}-")) / max(1, len(placed))
                shown = "inf" if p50 is None or math.isinf(p50) else f"{p50:,.0f}"
                row.append(f"{shown} ({len(results)}; {no_token} no token; {abroad:.0%} abroad)")
            print(f"| {policy} | {region} | " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
