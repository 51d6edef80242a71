"""Routing quality on the event model: the benchmark's plans through the what-if replay, in seconds.

    python benchmarks/routing_quality_events.py                       # 4 workloads x 3 seeds, ~1 min
    python benchmarks/routing_quality_events.py --workloads diurnal --policies gorgo,gorgo@greedy \
        --seeds 1,2,3,4,5,6,7 --param w_displacement=0.5

The wall-clock benchmark (``routing_quality.py``) takes ~5 minutes a workload on a shared 2-core
machine; this one runs the same seeded plans (``simulator.traffic.build_plan``, the same rates, fleet
and engine settings) through ``simulator.replay`` (the emulator's engine in virtual time, the real
routing code), so a change to a policy can be tried on every workload and many seeds in a minute,
then confirmed on the wall clock.
Only the gateways' algorithms run (no ``vllm-router``) and no outage (``region-outage`` is left out).
Gateways exchange their load every ``--sharing-delay-ms`` (100 ms: ``routing.state.sharing``'s
period), so each decides on its peers' load as it was up to two periods ago while its own work
counts at once, as on the wall clock; ``--sharing-delay-ms 0`` is the older, optimistic model in
which every gateway sees every other's load the moment it changes (no herding can happen there).

A multi-turn plan becomes replay requests as the runner would send them: the chat rendered as the
gateway renders it (``routing.cache.prompt.render_messages``), its prefix-chunk hashes, and a
deterministic stand-in for each answer (the emulator's answers are not known without running it).

Prints one line per (workload, policy): the median over the seeds of p50 and p99 TTFT (ms) and of
the cross-region share, each seed's p50/p99/cross-region share, and each client region's median p50.

``--against NAME=VALUE`` (repeatable) is an A/B in turns per seed: each policy also runs with those
parameters as the baseline on the same plans, and a second line gives the paired geometric-mean
ratios (this run over the baseline) of p50, p99 and each client region's p50, with the seeds where
the figure moved by more than 0.5 % either way:

    python benchmarks/routing_quality_events.py --workloads geo-chat,four-region --policies gorgo \
        --seeds $(seq -s, 1 40) --against homing_rent_ratio=0
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import sys
from pathlib import Path
from typing import Any

from routing_quality import (  # this directory is on sys.path
    GORGO_POLICIES,
    MAX_MODEL_LEN,
    MAX_TOKENS,
    SCENARIOS,
    WARMUP_SHARE,
    _params,
    node_engine,
    param_overrides_of,
    scenario_rate,
)
from wan_state import home_region, state_rtts_ms  # this directory is on sys.path

from routing.cache.approx_index import chunk_hashes
from routing.cache.bodies import ChatMessage
from routing.cache.prompt import render_messages
from routing.contract import ModelSpec, RegionSpec
from routing.state.sharing import LOAD_INTERVAL_S, PREFIX_FLUSH_INTERVAL_S
from simulator.replay import ReplayRequest, percentile, replay
from simulator.snapshots import make_node, make_snapshot
from simulator.text import text_of_tokens
from simulator.tokenizer import count_tokens
from simulator.topology import Topology, load_topology
from simulator.traffic import WorkloadPlan, build_plan

DEFAULT_WORKLOADS = ("geo-chat", "diurnal", "four-region", "mixed-length")
DEFAULT_POLICIES = ("least_load", "prefix_affinity", "prefix_affinity@local", "gorgo@greedy", "gorgo")
CHAT_TEMPLATE_TOKENS_PER_MESSAGE = 4


def replay_requests(plan: WorkloadPlan, model: str) -> list[ReplayRequest]:
    """Each arrival as the gateway would see it: its whole chat so far, hashed, and its length."""
    history: dict[str, list[ChatMessage]] = {}
    requests: list[ReplayRequest] = []
    for arrival in plan.arrivals:
        turns = history.setdefault(arrival.conversation_id, [])
        messages = (
            [ChatMessage("system", plan.system_prompts[arrival.system_prompt])]
            if (arrival.system_prompt is not None)
            else []
        )
        messages += [*turns, ChatMessage("user", arrival.user_text)]
        text = render_messages(messages)
        tokens = sum(count_tokens(str(m.content)) + CHAT_TEMPLATE_TOKENS_PER_MESSAGE for m in messages)
        requests.append(
            ReplayRequest(
                arrival.at_s,
                arrival.client_region,
                model,
                tokens,
                arrival.max_tokens,
                tuple(chunk_hashes(text)),
                len(text),
                session_key=arrival.user,
            )
        )
        answer = text_of_tokens(
            random.Random(f"{arrival.conversation_id}:{arrival.turn}"), arrival.max_tokens
        )
        turns += [ChatMessage("user", arrival.user_text), ChatMessage("assistant", answer)]
    return requests


def _store_rtt_arg(text: str) -> float | str:
    return "wan" if text == "wan" else float(text)


def _store_rtts_s(rtt_ms: float | str, topology: Any, scenario: Any) -> float | dict[str, float]:
    if rtt_ms != "wan":
        return float(rtt_ms) / 1000.0
    home = home_region(topology, scenario.client_shares)
    return {region: ms / 1000.0 for region, ms in state_rtts_ms(topology, home).items()}


def run(
    workload: str,
    policy: str,
    seed: int,
    requests: int,
    overrides: dict[str, float | bool],
    sharing_delay_ms: float = LOAD_INTERVAL_S * 1000.0,
    shared_state_rtt_ms: float | str = 0.0,
    prefix_delay_ms: float = PREFIX_FLUSH_INTERVAL_S * 1000.0,
    peer_claims: bool = True,
    topology_path: Path | None = None,
) -> dict[str, Any]:
    """One (workload, policy, seed) on the event model: p50/p99, cross-region share, per region.

    ``sharing_delay_ms``: the gateways' load-exchange period (0: peers' load seen at once);
    ``shared_state_rtt_ms``: the round trip from a gateway to the shared store, or ``"wan"``: the
    store in one region as the wall-clock ``--shared-state wan`` puts it (``wan_state``), each
    region's gateway at its round trip to it."""
    scenario = SCENARIOS[workload]
    if (
        topology_path is not None
    ):  # another fleet, every region's clients alike (routing_quality.py --topology)
        scenario = dataclasses.replace(scenario, topology_path=topology_path, client_shares=None)
    topology = load_topology(scenario.topology_path)
    rate = scenario_rate(scenario, topology)
    warmup = round(requests * WARMUP_SHARE)
    plan = build_plan(
        scenario.workload,
        [region.slug for region in topology.regions],
        rate_rps=rate,
        duration_s=(requests + warmup) / rate * 1.5,
        max_requests=requests + warmup,
        seed=seed,
        max_tokens=MAX_TOKENS,
        client_shares=scenario.client_shares,
    )
    traffic = replay_requests(plan, topology.nodes[0].model)
    algorithm, policy_params = GORGO_POLICIES[policy]
    params = _params(algorithm, {**policy_params, **overrides})
    outcome = replay(
        snapshot_of(topology, params),
        rtt_of(topology),
        traffic,
        scrape_interval_s=None,
        sharing_interval_s=sharing_delay_ms / 1000.0 or None,
        sharing_rtt_s=_store_rtts_s(shared_state_rtt_ms, topology, scenario),
        prefix_interval_s=prefix_delay_ms / 1000.0,
        peer_claims=peer_claims,
    )
    measured = outcome.requests[warmup:]
    ttfts = sorted(r.ttft_ms for r in measured if r.ttft_ms is not None)
    by_region: dict[str, list[float]] = {}
    for request, result in zip(traffic[warmup:], measured, strict=True):
        if result.ttft_ms is not None:
            by_region.setdefault(request.gateway_region, []).append(result.ttft_ms)
    return {
        "p50_ms": percentile(ttfts, 50),
        "p99_ms": percentile(ttfts, 99),
        "cross_region_share": sum(r.cross_region for r in measured) / max(1, len(measured)),
        "region_p50_ms": {region: percentile(sorted(v), 50) for region, v in sorted(by_region.items())},
        "unfinished": outcome.unfinished,
    }


def paired_ratios(rows: list[dict[str, Any]], baseline: list[dict[str, Any]]) -> dict[str, Any]:
    """Per figure, the geometric mean over the seeds of this run's figure over the baseline's (the
    same plan), and in how many seeds it was more than 0.5 % lower (better) or higher (worse)."""

    def summary(ratios: list[float]) -> dict[str, float | int]:
        return {
            "ratio": math.exp(statistics.mean(math.log(r) for r in ratios)),
            "better": sum(r < 0.995 for r in ratios),
            "worse": sum(r > 1.005 for r in ratios),
        }

    paired: dict[str, Any] = {
        figure: summary([row[figure] / base[figure] for row, base in zip(rows, baseline, strict=True)])
        for figure in ("p50_ms", "p99_ms")
    }
    paired["region_p50_ms"] = {
        region: summary(
            [
                row["region_p50_ms"][region] / base["region_p50_ms"][region]
                for row, base in zip(rows, baseline, strict=True)
            ]
        )
        for region in rows[0]["region_p50_ms"]
    }
    return paired


def format_paired(paired: dict[str, Any]) -> str:
    def one(name: str, figure: dict[str, Any]) -> str:
        return f"{name} x{figure['ratio']:.3f} (-{figure['better']}/+{figure['worse']})"

    regions = " ".join(one(region, figure) for region, figure in paired["region_p50_ms"].items())
    return f"{one('p50', paired['p50_ms'])} {one('p99', paired['p99_ms'])}  regions' p50: {regions}"


def snapshot_of(topology: Topology, params: Any) -> Any:
    """The fleet as the wall-clock benchmark runs it: each node's engine as ``node_engine`` says
    (the replay's engines are built from these specs)."""
    nodes = tuple(
        make_node(
            node_id,
            name=spec.name,
            region=spec.region,
            models=(spec.model,),
            max_num_seqs=node_engine(spec).max_num_seqs,
            prefill_tokens_per_s=node_engine(spec).prefill_tokens_per_s,
            kv_capacity_tokens=node_engine(spec).kv_capacity_tokens,
        )
        for node_id, spec in enumerate(topology.nodes, start=1)
    )
    model = topology.nodes[0]
    return make_snapshot(
        nodes,
        params=params,
        regions=tuple(RegionSpec(r.slug, r.name, r.latitude, r.longitude) for r in topology.regions),
        models=(ModelSpec(model.model, model.engine.block_size, MAX_MODEL_LEN),),
    )


def rtt_of(topology: Topology) -> dict[tuple[str, int], float]:
    """What the wall-clock benchmark publishes: the topology's RTT plus the mean jitter."""
    return {
        (region.slug, node_id): topology.rtt_ms(region.slug, spec.region)
        + topology.jitter_ms(region.slug, spec.region) / 2
        for region in topology.regions
        for node_id, spec in enumerate(topology.nodes, start=1)
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS))
    parser.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--requests", type=int, default=320, help="measured requests per run")
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a gorgo parameter, e.g. w_displacement=0.5",
    )
    parser.add_argument(
        "--sharing-delay-ms",
        type=float,
        default=LOAD_INTERVAL_S * 1000.0,
        help="how often gateways exchange their load (routing.state.sharing's period, the default); "
        "each sees its peers' as of their last write before its last read; 0: at once (the old model)",
    )
    parser.add_argument(
        "--shared-state-rtt-ms",
        type=_store_rtt_arg,
        default=0.0,
        help="round trip from a gateway to the shared Redis (0: loopback, as the wall-clock benchmark), "
        "or wan: Redis in one region, each region's gateway at its round trip to it (routing_quality.py "
        "--shared-state wan)",
    )
    parser.add_argument(
        "--prefix-delay-ms",
        type=float,
        default=PREFIX_FLUSH_INTERVAL_S * 1000.0,
        help="how often gateways publish their prefix-index insertions (routing.state.sharing's period, "
        "the default); 0: one index for all gateways, updated at once; only with --sharing-delay-ms",
    )
    parser.add_argument(
        "--no-peer-claims",
        action="store_true",
        help="the gateways before issue 24's claims: a peer's prefix update moves the index only, "
        "its work counts from the peer's next load report",
    )
    parser.add_argument(
        "--topology",
        type=Path,
        default=None,
        help="topology file for every workload (simulator format; as routing_quality.py --topology)",
    )
    parser.add_argument(
        "--against",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="also run every policy with these parameters as the baseline and print paired ratios",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="also write every seed's figures to OUT.json and the summary lines to OUT.md",
    )
    args = parser.parse_args(argv)
    overrides = param_overrides_of(args.param)
    against = param_overrides_of(args.against) if args.against else None
    seeds = [int(seed) for seed in args.seeds.split(",") if seed.strip()]
    results: list[dict[str, Any]] = []
    lines: list[str] = []
    for workload in args.workloads.split(","):
        if workload not in SCENARIOS or SCENARIOS[workload].workload == "region-outage":
            raise SystemExit(f"error: {workload!r} is not a workload the event model runs")
        for policy in args.policies.split(","):
            rows = [
                run(
                    workload,
                    policy,
                    seed,
                    args.requests,
                    overrides,
                    args.sharing_delay_ms,
                    args.shared_state_rtt_ms,
                    args.prefix_delay_ms,
                    not args.no_peer_claims,
                    args.topology,
                )
                for seed in seeds
            ]
            p50 = statistics.median(row["p50_ms"] for row in rows)
            p99 = statistics.median(row["p99_ms"] for row in rows)
            cross = statistics.median(row["cross_region_share"] for row in rows)
            regions = {
                region: round(statistics.median(row["region_p50_ms"][region] for row in rows))
                for region in rows[0]["region_p50_ms"]
            }
            each = " ".join(
                f"{row['p50_ms']:.0f}/{row['p99_ms']:.0f}/{row['cross_region_share']:.0%}" for row in rows
            )
            line = f"{workload:>13} {policy:<22} p50 {p50:6.0f} p99 {p99:6.0f} cross {cross:4.0%}  [{each}]  {regions}"
            print(line, flush=True)
            lines.append(line)
            result: dict[str, Any] = {
                "workload": workload,
                "policy": policy,
                "p50_ms": p50,
                "p99_ms": p99,
                "cross_region_share": cross,
                "region_p50_ms": regions,
                "seeds": dict(zip(seeds, rows, strict=True)),
            }
            if against is not None:
                baseline = [
                    run(
                        workload,
                        policy,
                        seed,
                        args.requests,
                        {**overrides, **against},
                        args.sharing_delay_ms,
                        args.shared_state_rtt_ms,
                        args.prefix_delay_ms,
                        not args.no_peer_claims,
                        args.topology,
                    )
                    for seed in seeds
                ]
                paired = paired_ratios(rows, baseline)
                line = f"{'':>13} {'  over ' + ','.join(args.against):<22} " + format_paired(paired)
                print(line, flush=True)
                lines.append(line)
                result["against"] = against
                result["baseline_seeds"] = dict(zip(seeds, baseline, strict=True))
                result["paired"] = paired
            results.append(result)
    if args.out is not None:
        meta = {
            "seeds": seeds,
            "requests": args.requests,
            "params": overrides,
            "sharing_delay_ms": args.sharing_delay_ms,
            "shared_state_rtt_ms": args.shared_state_rtt_ms,
            "prefix_delay_ms": args.prefix_delay_ms,
            "peer_claims": not args.no_peer_claims,
            "topology": str(args.topology) if args.topology else None,
            "against": against,
            "command": " ".join(["python", "benchmarks/routing_quality_events.py", *(argv or sys.argv[1:])]),
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(
            json.dumps({"meta": meta, "results": results}, indent=1) + "\n"
        )
        summary = "\n".join(lines)
        args.out.with_suffix(".md").write_text(
            f"# Event model: {meta['command']}\n\nMedian over the seeds of p50 / p99 TTFT (ms) and cross-region"
            " share; each seed's p50/p99/cross; each client region's median p50.\n\n"
            f"```\n{summary}\n```\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
