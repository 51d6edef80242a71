"""The figures of a routing-quality run and its outputs: JSON, a markdown report, a PNG of TTFT CDFs.

Used by ``benchmarks/routing_quality.py``; no processes or I/O besides writing the three files.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from routing.contract import ALGORITHMS, RequestRecord
from simulator.traffic.report import percentile
from simulator.traffic.runner import RequestResult

PEER = "vllm-router"
# The baselines in the contract's order, the peer, then gorgo (the subject) last.
POLICY_ORDER = (*(name for name in ALGORITHMS if name != "gorgo"), PEER, "gorgo")
REGION_ORDER = ("us-east", "eu-central", "ap-south")
COLORS = {
    "round_robin": "#9e9e9e",
    "least_load": "#1f77b4",
    "session_affinity": "#8c564b",
    "prefix_affinity": "#ff7f0e",
    "vllm-router": "#9467bd",
    "gorgo": "#2ca02c",
}


class RunOutputLike(Protocol):
    results: list[RequestResult]
    warmup_requests: int
    node_counters: dict[str, dict[str, float]]
    node_regions: dict[str, str]
    arrival_window_s: float
    records: list[RequestRecord]


@dataclass
class RegionFigures:
    """What the clients of one region saw."""

    requests: int
    errors: int
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    ttft_p99_ms: float | None
    cross_region_share: float | None


@dataclass
class RunFigures:
    """One (workload, policy) run after its warm-up. TTFT percentiles cover successful requests.

    ``errors`` counts every failed request, warm-up included, so no failure hides there.
    """

    requests: int  # measured (after the warm-up)
    warmup_requests: int
    errors: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    prefix_hit_rate: float  # the nodes' prefix-cache hits / queries, tokens, from /metrics
    cross_region_share: float  # answered by a node outside the client's region
    # Offered prefill load: prompt tokens the nodes computed (not cached) for the measured
    # requests / what the fleet can prefill in their arrival window.
    prefill_utilization: float
    computed_prefill_tokens: int
    preemptions: int
    arrival_window_s: float
    # How late the client sent first turns against the plan (p99, ms): a harness health check;
    # a large value means this machine could not drive the rate and the run is suspect.
    send_lag_p99_ms: float
    requests_per_node: dict[str, int]
    by_region: dict[str, RegionFigures]
    gateway: dict[str, Any] | None = None  # from the gorgo gateways' request records
    ttfts_ms: list[float] = field(default_factory=list, repr=False)  # for the CDF; not in the JSON

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("ttfts_ms")
        return _rounded(data)


def summarize_run(output: RunOutputLike, prefill_tokens_per_s: float) -> RunFigures:
    everything = output.results
    results = [r for r in everything if r.index >= output.warmup_requests]
    ok = [r for r in results if r.ok and r.ttft_ms is not None]
    ttfts = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    node_regions = output.node_regions
    queries = sum(c["queries"] for c in output.node_counters.values())
    hits = sum(c["hits"] for c in output.node_counters.values())
    computed = queries - hits
    capacity = prefill_tokens_per_s * len(output.node_counters) * output.arrival_window_s
    per_node: dict[str, int] = dict.fromkeys(sorted(node_regions), 0)
    for result in ok:
        if result.node in per_node:
            per_node[result.node] += 1
    by_region: dict[str, RegionFigures] = {}
    for region in sorted({r.client_region for r in results}, key=_region_key):
        mine = [r for r in results if r.client_region == region]
        mine_ok = [r for r in ok if r.client_region == region]
        values = [r.ttft_ms for r in mine_ok if r.ttft_ms is not None]
        by_region[region] = RegionFigures(
            requests=len(mine),
            errors=len(mine) - len(mine_ok),
            ttft_p50_ms=percentile(values, 50),
            ttft_p90_ms=percentile(values, 90),
            ttft_p99_ms=percentile(values, 99),
            cross_region_share=_cross_share(mine_ok, node_regions),
        )
    return RunFigures(
        requests=len(results),
        warmup_requests=len(everything) - len(results),
        errors=sum(1 for r in everything if not (r.ok and r.ttft_ms is not None)),
        ttft_p50_ms=percentile(ttfts, 50) or 0.0,
        ttft_p90_ms=percentile(ttfts, 90) or 0.0,
        ttft_p99_ms=percentile(ttfts, 99) or 0.0,
        prefix_hit_rate=hits / queries if queries else 0.0,
        cross_region_share=_cross_share(ok, node_regions) or 0.0,
        prefill_utilization=computed / capacity if capacity else 0.0,
        computed_prefill_tokens=int(computed),
        preemptions=int(sum(c["preemptions"] for c in output.node_counters.values())),
        arrival_window_s=output.arrival_window_s,
        send_lag_p99_ms=percentile(
            [(r.sent_s - r.scheduled_s) * 1000.0 for r in everything if r.turn == 0 and r.sent_s is not None],
            99,
        )
        or 0.0,
        requests_per_node=per_node,
        by_region=by_region,
        gateway=_gateway_figures(output.records) if output.records else None,
        ttfts_ms=ttfts,
    )


def _cross_share(results: list[RequestResult], node_regions: Mapping[str, str]) -> float | None:
    placed = [r for r in results if r.node in node_regions]
    if not placed:
        return None
    return sum(1 for r in placed if node_regions[r.node or ""] != r.client_region) / len(placed)


def _gateway_figures(records: list[RequestRecord]) -> dict[str, Any]:
    """What the gateways logged: decision time, the index's predictions, and 499s (should be 0)."""
    routing_us = [r.routing_us for r in records if r.node_id is not None]
    predicted = sum(r.cost.matched_tokens for r in records if r.cost is not None)
    estimated = sum(r.prompt_tokens_est for r in records if r.cost is not None)
    cached = sum(r.cached_tokens or 0 for r in records if r.prompt_tokens)
    prompt = sum(r.prompt_tokens or 0 for r in records)
    return {
        "records": len(records),
        "status_499": sum(1 for r in records if r.status == 499),
        "routing_us_p50": percentile(routing_us, 50),
        "routing_us_p99": percentile(routing_us, 99),
        "index_predicted_hit_rate": predicted / estimated if estimated else None,
        "observed_hit_rate": cached / prompt if prompt else None,
        "records_with_matched_tokens": sum(
            1 for r in records if r.cost is not None and r.cost.matched_tokens > 0
        ),
    }


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 4 if abs(value) < 10 else 1)
    if isinstance(value, dict):
        return {key: _rounded(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_rounded(item) for item in value]
    return value


def _region_key(region: str) -> tuple[int, str]:
    return (REGION_ORDER.index(region) if region in REGION_ORDER else len(REGION_ORDER), region)


def _policy_key(policy: str) -> tuple[int, str]:
    return (POLICY_ORDER.index(policy) if policy in POLICY_ORDER else len(POLICY_ORDER), policy)


# ---- targets -----------------------------------------------------------------------------------


def evaluate_targets(runs: Mapping[str, Mapping[str, RunFigures]]) -> list[dict[str, Any]]:
    """The issue's targets, for the workloads and policies that ran.

    Each: gorgo's figure, the figure it is held against (the best other policy at that
    percentile, or least_load), their ratio and the largest ratio the target allows.
    """
    targets: list[dict[str, Any]] = []

    def add(workload: str, name: str, gorgo_ms: float, against: str, against_ms: float, limit: float) -> None:
        ratio = gorgo_ms / against_ms if against_ms else float("inf")
        targets.append(
            {
                "workload": workload,
                "target": name,
                "gorgo_ms": round(gorgo_ms, 1),
                "against": against,
                "against_ms": round(against_ms, 1),
                "ratio": round(ratio, 3),
                "limit_ratio": limit,
                "met": ratio <= limit,
            }
        )

    geo = runs.get("geo-chat", {})
    if "gorgo" in geo and len(geo) > 1:
        others = {p: f for p, f in geo.items() if p != "gorgo"}
        best50 = min(others, key=lambda p: others[p].ttft_p50_ms)
        best99 = min(others, key=lambda p: others[p].ttft_p99_ms)
        gorgo = geo["gorgo"]
        add(
            "geo-chat",
            "p50 <= 0.8x the best other",
            gorgo.ttft_p50_ms,
            best50,
            others[best50].ttft_p50_ms,
            0.8,
        )
        add(
            "geo-chat",
            "p99 <= 0.9x the best other",
            gorgo.ttft_p99_ms,
            best99,
            others[best99].ttft_p99_ms,
            0.9,
        )
    share = runs.get("no-share", {})
    if {"gorgo", "least_load"} <= share.keys():
        gorgo, base = share["gorgo"], share["least_load"]
        add(
            "no-share", "p50 within 5% of least_load", gorgo.ttft_p50_ms, "least_load", base.ttft_p50_ms, 1.05
        )
        add(
            "no-share", "p99 within 5% of least_load", gorgo.ttft_p99_ms, "least_load", base.ttft_p99_ms, 1.05
        )
    hot = runs.get("hot-prefix", {})
    if {"gorgo", "least_load"} <= hot.keys():
        gorgo, base = hot["gorgo"], hot["least_load"]
        add("hot-prefix", "p99 <= least_load", gorgo.ttft_p99_ms, "least_load", base.ttft_p99_ms, 1.0)
    return targets


# ---- outputs -----------------------------------------------------------------------------------


def write_outputs(
    out: Path, meta: dict[str, Any], runs: Mapping[str, Mapping[str, RunFigures]]
) -> list[Path]:
    targets = evaluate_targets(runs)
    document = {
        "meta": meta,
        "workloads": {
            workload: {
                "rate_rps": meta["rates_rps"].get(workload),
                "policies": {p: runs[workload][p].to_json() for p in sorted(runs[workload], key=_policy_key)},
            }
            for workload in runs
        },
        "targets": targets,
    }
    json_path = out.with_suffix(".json")
    json_path.write_text(json.dumps(document, indent=1) + "\n")
    md_path = out.with_suffix(".md")
    md_path.write_text(markdown(meta, runs, targets, out.with_suffix(".png").name))
    paths = [json_path, md_path]
    png_path = out.with_suffix(".png")
    if plot_cdfs(png_path, runs):
        paths.append(png_path)
    return paths


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def markdown(
    meta: dict[str, Any],
    runs: Mapping[str, Mapping[str, RunFigures]],
    targets: list[dict[str, Any]],
    chart_name: str,
) -> str:
    lines = [
        "# Routing quality",
        "",
        f"`{meta['command']}` on {meta['machine']}, {meta['date']}; {meta['duration_s']:.0f} s in all; "
        f"{meta['requests_per_run']:,} requests per run, seed {meta['seed']}, answers of at most "
        f"{meta['max_tokens']} tokens. TTFT: request sent by the client to first content token, in ms.",
        "",
    ]
    if meta.get("quick"):
        lines += ["**Quick smoke run: too few requests for stable percentiles.**", ""]
    for note in meta.get("notes", []):
        lines += [f"- {note}"]
    if meta.get("notes"):
        lines.append("")
    lines += [
        "## Targets",
        "",
        "| workload | target | gorgo ms | against | its ms | ratio | allowed | met |",
        "|---|---|---:|---|---:|---:|---:|---|",
    ]
    for t in targets:
        verdict = "yes" if t["met"] else f"**no** (by {t['ratio'] / t['limit_ratio'] - 1:.0%})"
        lines.append(
            f"| {t['workload']} | {t['target']} | {_ms(t['gorgo_ms'])} | {t['against']} | "
            f"{_ms(t['against_ms'])} | {t['ratio']:.2f} | {t['limit_ratio']:.2f} | {verdict} |"
        )
    lines.append("")
    for workload, policies in runs.items():
        order = sorted(policies, key=_policy_key)
        rate = meta["rates_rps"].get(workload)
        lines += [
            f"## {workload} ({rate:g} requests/s)",
            "",
            "| policy | p50 | p90 | p99 | prefix hit rate | cross-region | errors | prefill load | preemptions | client lag p99 |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for policy in order:
            f = policies[policy]
            name = f"**{policy}**" if policy == "gorgo" else policy
            lines.append(
                f"| {name} | {_ms(f.ttft_p50_ms)} | {_ms(f.ttft_p90_ms)} | {_ms(f.ttft_p99_ms)} | "
                f"{_pct(f.prefix_hit_rate)} | {_pct(f.cross_region_share)} | {f.errors} | "
                f"{_pct(f.prefill_utilization)} | {f.preemptions} | {_ms(f.send_lag_p99_ms)} |"
            )
        regions = sorted({r for f in policies.values() for r in f.by_region}, key=_region_key)
        lines += ["", "TTFT p50 / p90 / p99 (cross-region share) by client region:", ""]
        lines.append("| policy | " + " | ".join(regions) + " |")
        lines.append("|---|" + "---:|" * len(regions))
        for policy in order:
            cells = []
            for region in regions:
                r = policies[policy].by_region.get(region)
                cells.append(
                    "-"
                    if r is None
                    else f"{_ms(r.ttft_p50_ms)} / {_ms(r.ttft_p90_ms)} / {_ms(r.ttft_p99_ms)} ({_pct(r.cross_region_share)})"
                )
            lines.append(f"| {policy} | " + " | ".join(cells) + " |")
        gateway_rows = [(p, policies[p].gateway) for p in order if policies[p].gateway]
        if gateway_rows:
            lines += [
                "",
                "What the gorgo gateways logged (request records):",
                "",
                "| policy | decision p50 us | p99 us | index predicted hit | nodes' hit | 499s |",
                "|---|---:|---:|---:|---:|---:|",
            ]
            for policy, g in gateway_rows:
                assert g is not None
                predicted = g["index_predicted_hit_rate"]
                lines.append(
                    f"| {policy} | {_ms(g['routing_us_p50'])} | {_ms(g['routing_us_p99'])} | "
                    f"{'-' if predicted is None or policy not in ('gorgo', 'prefix_affinity') else _pct(predicted)} | "
                    f"{_pct(g['observed_hit_rate'])} | {g['status_499']} |"
                )
        lines.append("")
    lines += [f"![TTFT CDFs per policy]({chart_name})", "", NOTES.strip(), ""]
    return "\n".join(lines)


def plot_cdfs(path: Path, runs: Mapping[str, Mapping[str, RunFigures]]) -> bool:
    """One subplot per workload: the TTFT CDF of every policy (log time axis)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    workloads = list(runs)
    if not workloads:
        return False
    figure, axes = plt.subplots(1, len(workloads), figsize=(5.2 * len(workloads), 4.2), squeeze=False)
    for axis, workload in zip(axes[0], workloads, strict=True):
        for policy in sorted(runs[workload], key=_policy_key):
            values = sorted(runs[workload][policy].ttfts_ms)
            if not values:
                continue
            fractions = [(index + 1) / len(values) for index in range(len(values))]
            axis.step(
                values,
                fractions,
                where="post",
                label=policy,
                color=COLORS.get(policy),
                linewidth=2.2 if policy == "gorgo" else 1.3,
            )
        axis.set_xscale("log")
        axis.set_title(workload)
        axis.set_xlabel("TTFT (ms, log scale)")
        axis.set_ylim(0, 1.0)
        axis.grid(True, which="both", alpha=0.3)
        axis.axhline(0.99, color="black", linewidth=0.6, linestyle=":")
    axes[0][0].set_ylabel("fraction of requests")
    axes[0][-1].legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


# The method and the discussion, hand-written (kept here so the report is whole). Figures quoted
# here come from the calibration runs, not from the tables above, which each run rewrites.
NOTES = """
## How it was run

- **Fleet.** The simulator's default topology: us-east, eu-central and ap-south, two nodes each,
  RTTs 1.5 ms inside a region, 88 ms us-east/eu-central, 120 ms eu-central/ap-south, 235 ms
  us-east/ap-south (plus up to 2-4 ms jitter). Every node prefills 10,638 tokens/s (the GORGO
  paper's 0.094 ms/token), decodes as the emulated H100 (6.5 ms a step + 0.06 ms per sequence),
  and holds 2,048 KV blocks of 16 tokens (32,768 tokens: the six geo-chat system prompts alone
  take 28.5k, so caches evict), with `max_model_len` 16,384. All six nodes run in one process;
  a fresh fleet (empty caches) for every run.
- **Routers.** The five gorgo policies run in one gateway process per region (`python -m routing`),
  under a Redis prefix of the run's own: a new index, load exchange and request log each run.
  The policy is a `PolicySnapshot` written to Redis with the contract's structs, and the RTT
  table is an `RTTTable` computed from the topology (RTT + mean jitter, what the telemetry
  probes converge to; telemetry itself is tested separately). No telemetry runs, so no node
  live state: the gateways know load from their own and each other's outstanding requests.
  The peer, `vllm-router` 0.1.17 (`cache_aware`, its defaults), runs one instance per region
  over all six nodes through the nodes' ports for that region, so its requests pay the same
  emulated WAN as the gateways' (`X-Gorgo-Region`).
- **Traffic.** `simulator.traffic` plans with seed 1, the same arrivals for every policy; clients
  in each region send to their own region's gateway or router; streamed answers of at most 128
  tokens; TTFT is measured by the client, from sending the request to the first content token.
  The first 10 % of arrivals warm the caches and are not counted (every policy starts cold; the
  cold prefills of the first second would otherwise be most of the p99 of a short run); then
  1,000 requests are measured. Errors count every request, warm-up included.
- **Load.** "Prefill load" is the offered load: prompt tokens the nodes had to compute (not
  served from their prefix cache; from their `/metrics`) for the measured requests, over what
  the fleet can prefill in their arrival window (6 x 10,638 tokens/s). Rates were calibrated
  (`--calibrate`) so that the cache-oblivious `least_load` baseline offers ~65 %: at 44/s
  geo-chat measured 69 % (hence 42/s), no-share at 20/s 64 % (hence 20.4/s). Policies that reuse
  the cache offer less load at the same arrivals: that is the point of them. hot-prefix would need
  ~290 requests/s for 65 % (95 % of its prompt is one cached 4k-token prefix); this 2-vCPU machine
  drives ~80/s with the client on schedule (send lag p99 of a few ms; 20-40 ms at 100/s), so
  hot-prefix runs at 80/s, under 20 % load: it tests the hot prefix's placement, not a busy fleet.
- **Harness.** Everything (fleet, 3 gateways or routers, Redis, the client) shares the 2 vCPUs.
  The gateways' decision times in the tables include that contention (in isolation:
  benchmarks/routing_decision.md). "client lag p99" (ms) is how late the client sent first turns
  against the plan: a check that the machine itself was not the bottleneck.

## Reading the results

- **geo-chat**: gorgo sends nearly every request to its own region (the RTT term) and to the
  node that holds its conversation (the prefill term), so its TTFT is the local RTT plus a short
  prefill. Cache-oblivious policies send two thirds of the requests across regions and, with
  every system prompt on every node, thrash the small caches (more computed prefill, more load,
  preemptions). prefix_affinity keeps the cache hits but ignores the network. The peer pays, on
  every request, a round trip to its farthest worker before routing: `vllm-router` 0.1.17's
  `cache_aware` asks *every* worker to render (tokenize) the chat request
  (`/v1/chat/completions/render`, falling back to `/tokenize`) and waits for all of them; next
  to co-located workers that costs a millisecond, across regions 120-237 ms. It also pins a shared
  prefix to one node until 64 requests of imbalance (its default), queueing behind it.
- **no-share**: nothing can be cached, so gorgo's advantage is the network term: it serves
  locally while the local queue is shorter than the round trip to a remote node, and spills
  otherwise. least_load balances by outstanding requests everywhere, so two thirds of its
  requests pay a cross-region RTT.
- **hot-prefix**: every node holds the hot prefix after the warm-up, so the cache does not
  separate the nodes; gorgo stays local, the others pay the WAN on two thirds of requests.

If a re-run misses a target the Targets table says by how much; docs/routing.md discusses what
each term buys and where it would not.
"""
