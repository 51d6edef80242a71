"""A routing-quality run by phase: what each region's clients saw in each part of the run.

Reads the per-request output of a routing-quality run (``routing_quality.py --raw DIR``) and prints
a markdown table: per policy and client region, the TTFT p50 and p99 (a request with no first token
counts as inf, as in the report), how many requests there were and how many got no first token, and
the share answered abroad, for the phases of the run. With an outage (region-outage):

- before: sent before the outage region's nodes stopped;
- down: the outage's first ``DETECTION_S`` (the routers do not know yet);
- outage: the rest of the outage and ``DETECTION_S`` after it (they do not know it ended);
- after: from then on.

Without one (every other workload, and ``<workload>@wan-redis``):

- cold: sent in the run's first ``--cold-s`` seconds (default 3), while the fleet's caches are
  still cold (the warm-up arrivals are left out, as in the report);
- warm: from then on.

    python benchmarks/routing_quality.py --workloads region-outage --raw var/rq/raw --out var/rq/region-outage
    python benchmarks/routing_quality_phases.py var/rq/raw --policies vllm-router@local,prefix_affinity@local,gorgo
    python benchmarks/routing_quality.py --workloads geo-chat --policies gorgo --shared-state wan --front-door \
        --raw var/wan/raw --out var/wan/geo-chat
    python benchmarks/routing_quality_phases.py var/wan/raw --workload geo-chat@wan-redis

The outage's times come from the plan, rebuilt from the seed in each file's name with the run's
parameters (``--requests`` and ``--rate`` when the run changed them).

A second table says how right gorgo's estimate was in each phase, for the runs where gorgo decided:
from the gateways' request records (``....records.jsonl``), per
phase and for requests served at home and abroad, the median and p90 of TTFT (at the gateway)
minus the TTFT the decision priced (round trip + queue + prefill). A record's phase is its arrival
at the gateway counted from the run's first record (warm-up included).
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
from wan_state import WAN_SUFFIX  # this directory is on sys.path

from routing.contract import RequestRecord
from simulator.topology import load_topology
from simulator.traffic.runner import RequestResult
from simulator.traffic.workloads import build_plan

OUTAGE_PHASES = ("before", "down", "outage", "after")
COLD_PHASES = ("cold", "warm")
COLD_S = 3.0


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
    parser.add_argument(
        "--cold-s",
        type=float,
        default=COLD_S,
        help="without an outage: the run's first seconds counted as cold",
    )
    args = parser.parse_args(argv)
    name = args.workload.removesuffix(WAN_SUFFIX)
    if name not in SCENARIOS:
        raise SystemExit(f"error: unknown workload {args.workload!r}")
    scenario = SCENARIOS[name]
    phases = OUTAGE_PHASES if scenario.workload == "region-outage" else COLD_PHASES
    topology = load_topology(scenario.topology_path)
    regions = [region.slug for region in topology.regions]
    rate = args.rate or scenario_rate(scenario, topology)
    warmup = round(args.requests * WARMUP_SHARE)
    wanted = args.policies.split(",") if args.policies else None
    cells: dict[tuple[str, str, str], list[RequestResult]] = defaultdict(list)
    # (policy, phase, "home" or "abroad") -> TTFT minus the priced TTFT, ms
    errors: dict[tuple[str, str, str], list[float]] = defaultdict(list)
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
        outage = plan.outages[0] if plan.outages else None
        if policy not in policies:
            policies.append(policy)
        for line in path.read_bytes().splitlines():
            result = msgspec.json.decode(line, type=RequestResult)
            if result.index < warmup:
                continue
            sent_s = result.sent_s if result.sent_s is not None else result.scheduled_s
            if outage is not None:
                phase = phase_of(sent_s, outage.start_s, outage.end_s)
            else:
                phase = "cold" if sent_s < args.cold_s else "warm"
            cells[(policy, result.client_region, phase)].append(result)
        records_path = path.with_name(f"{path.stem}.records.jsonl")
        if records_path.exists():
            records = [
                msgspec.json.decode(line, type=RequestRecord)
                for line in records_path.read_bytes().splitlines()
            ]
            start_s = min((r.ts for r in records), default=0.0)
            for record in records:
                cost = record.cost
                if (
                    record.algorithm
                    != "gorgo"  # another policy's record is priced by gorgo's model, not decided on it
                    or cost is None
                    or cost.node_id != record.node_id
                    or record.ttft_ms is None
                ):
                    continue
                at_s = record.ts - start_s
                if outage is not None:
                    phase = phase_of(at_s, outage.start_s, outage.end_s)
                else:
                    phase = "cold" if at_s < args.cold_s else "warm"
                where = "home" if record.node_region == record.gateway_region else "abroad"
                priced_ms = cost.rtt_ms + cost.queue_ms + cost.prefill_ms
                errors[(policy, phase, where)].append(record.ttft_ms - priced_ms)
    if not cells:
        raise SystemExit(f"error: no {args.workload} runs in {args.raw}")
    print("TTFT p50 / p99 ms (requests; without a first token; answered abroad)\n")
    print("| policy | clients | " + " | ".join(phases) + " |")
    print("|---|---|" + "---:|" * len(phases))
    for policy in wanted or policies:
        for region in regions:
            row = []
            for phase in phases:
                results = cells.get((policy, region, phase), [])
                if not results:
                    row.append("-")
                    continue
                ttfts = [measured_ttft_ms(r) for r in results]
                p50, p99 = ttft_percentile(ttfts, 50), ttft_percentile(ttfts, 99)
                no_token = sum(1 for r in results if r.ttft_ms is None)
                placed = [r for r in results if r.node]
                abroad = sum(1 for r in placed if not r.node.startswith(f"{region}-")) / max(1, len(placed))
                row.append(f"{_ms(p50)} / {_ms(p99)} ({len(results)}; {no_token}; {abroad:.0%})")
            print(f"| {policy} | {region} | " + " | ".join(row) + " |")
    priced = [policy for policy in wanted or policies if any(key[0] == policy for key in errors)]
    if priced:
        print("\nTTFT minus the priced TTFT, ms: median / p90 (requests), served at home and abroad\n")
        print("| policy | served | " + " | ".join(phases) + " |")
        print("|---|---|" + "---:|" * len(phases))
        for policy in priced:
            for where in ("home", "abroad"):
                row = []
                for phase in phases:
                    values = sorted(errors.get((policy, phase, where), []))
                    if not values:
                        row.append("-")
                        continue
                    median = values[len(values) // 2]
                    p90 = values[min(len(values) - 1, int(0.9 * len(values)))]
                    row.append(f"{median:+,.0f} / {p90:+,.0f} ({len(values)})")
                print(f"| {policy} | {where} | " + " | ".join(row) + " |")
    return 0


def _ms(value: float | None) -> str:
    return "inf" if value is None or math.isinf(value) else f"{value:,.0f}"


if __name__ == "__main__":
    sys.exit(main())
