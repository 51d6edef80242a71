"""The figures of a routing-quality run and its outputs: JSON, a markdown report, a PNG of TTFT CDFs.

Used by ``benchmarks/routing_quality.py``; no processes or I/O besides writing the three files.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from routing.contract import ALGORITHMS, RequestRecord
from simulator.traffic.report import percentile
from simulator.traffic.runner import RequestResult

NO_ANSWER = math.inf  # the TTFT of a measured request that got no first token

PEER = "vllm-router"
PEER_LOCAL = "vllm-router@local"
# What operators deploy today: geo-DNS to the nearest region, a cache-aware router per region.
REGIONAL = (PEER_LOCAL, "prefix_affinity@local")
# The GORGO paper's own router (PyPI gorgo-lb), run by benchmarks/gorgo_lb_peer.py (its VARIANTS):
# one per region with the package's weights, one central proxy, the package's ES tuner on, the 2D
# model with the fleet's prefill speed, its AIBrix-derived prefix-cache baseline, and the nodes'
# load scraped every 100 ms instead of every 5 s.
GORGO_LB = (
    "gorgo-lb",
    "gorgo-lb@central",
    "gorgo-lb+es",
    "gorgo-lb-2d",
    "gorgo-lb/prefix-cache",
    "gorgo-lb@scrape-100ms",
)
# The global baselines in the contract's order, the peer, the regional ones, gorgo-lb, gorgo last.
POLICY_ORDER = (
    *(name for name in ALGORITHMS if name != "gorgo"),
    PEER,
    *REGIONAL,
    *GORGO_LB,
    "gorgo@greedy",
    "gorgo",
)
REGION_ORDER = ("us-east", "eu-central", "ap-south")
COLORS = {
    "round_robin": "#9e9e9e",
    "least_load": "#1f77b4",
    "session_affinity": "#8c564b",
    "prefix_affinity": "#ff7f0e",
    "vllm-router": "#9467bd",
    "vllm-router@local": "#c5b0d5",
    "prefix_affinity@local": "#ffbb78",
    "gorgo-lb": "#d62728",
    "gorgo-lb@central": "#ff9896",
    "gorgo-lb+es": "#e377c2",
    "gorgo-lb-2d": "#7f7f7f",
    "gorgo-lb/prefix-cache": "#bcbd22",
    "gorgo-lb@scrape-100ms": "#17becf",
    "gorgo@greedy": "#98df8a",
    "gorgo": "#2ca02c",
}


@dataclass(frozen=True)
class Served:
    """One request's time at the node that served it, beside its oracle bound's (ms).

    From the simulator's log (``GET /oracle``): ``intake_ms`` from its HTTP request's arrival at
    the node to the engine (the emulator reading, parsing and tokenizing it in the fleet's one
    process, a harness cost no real node has in this form), ``queue_ms`` from there to its first
    scheduled step, ``prefill_ms`` from there to its first token (prefill steps shared with the
    batch's decodes), ``lag_ms`` how late the fleet's process wrote that token out past when it was
    due (its event loop's lag on a busy machine, another harness cost); ``rtt_ms`` the topology's
    RTT between the client's region and the node's.
    The bound (``simulator.fleet.Fleet.record_oracle``) is ``bound_rtt_ms`` + ``bound_compute_ms``
    (one step + the prefill of what its node lacked), with no queue.
    """

    rtt_ms: float
    intake_ms: float
    queue_ms: float
    prefill_ms: float
    lag_ms: float
    bound_rtt_ms: float
    bound_compute_ms: float


# Where a request's TTFT goes (``attribute``): the four terms add up to the client's TTFT.
TERMS = ("rtt", "intake", "queue", "prefill", "lag", "other")


class RunOutputLike(Protocol):
    results: list[RequestResult]
    warmup_requests: int
    node_counters: dict[str, dict[str, float]]
    node_regions: dict[str, str]
    arrival_window_s: float
    records: list[RequestRecord]
    oracle_ms: dict[int, float]
    peer_state: dict[str, Any] | None
    served: dict[int, Served]


@dataclass
class RegionFigures:
    """What the clients of one region saw, and what its nodes took in from abroad.

    TTFT percentiles over every measured request of the region, as ``RunFigures``'s: one that got
    no first token counts as infinitely slow."""

    requests: int
    errors: int
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    ttft_p99_ms: float | None
    cross_region_share: float | None
    oracle_p50_ms: float | None = None  # the lower bound of the same requests
    served_from_abroad: float | None = None  # of the requests its nodes answered, from other regions


@dataclass
class RunFigures:
    """One (workload, policy) run after its warm-up.

    TTFT percentiles cover every measured request: one that got no first token (refused, a 5xx,
    dropped before its first token, timed out) counts as TTFT = +inf (``NO_ANSWER``), so a policy
    cannot improve its percentiles by failing its slowest requests (a region's requests during an
    outage); a request that failed after its first token counts with the TTFT it had. A percentile
    that falls on a failure is +inf (``inf`` in the markdown, ``null`` in the JSON). ``errors``
    counts every failed request, warm-up included, so no failure hides there.
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
    # the oracle bound of the measured successful requests (simulator, at arrival; no queue)
    oracle_p50_ms: float | None = None
    oracle_p99_ms: float | None = None
    # gorgo-lb: per adapter region, the weights it ended with and its ES tuner's steps
    gorgo_lb: dict[str, Any] | None = None
    # Where the TTFT of the measured successful requests went, and their gap to the bound
    # (``attribute``); None when the fleet logged no service times
    attribution: dict[str, Any] | None = None
    # where the run's wall clock went, seconds per phase (routing_quality.Phases); None: not timed
    phases_s: dict[str, float] | None = None
    # answers the harness stopped reading after their first token (every request had its own)
    cut_after_first_token: int = 0
    # every measured request's TTFT (+inf: no first token), for the CDF; not in the JSON
    ttfts_ms: list[float] = field(default_factory=list, repr=False)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("ttfts_ms")
        return _rounded(data)


def measured_ttft_ms(result: RequestResult) -> float:
    """A request's TTFT for the percentiles: +inf when no first token came (it failed before)."""
    return result.ttft_ms if result.ttft_ms is not None else NO_ANSWER


# Percentiles over TTFTs where +inf stands for a request that got no first token: the fleet
# report's own percentile handles +inf (a rank next to a failure is +inf).
ttft_percentile = percentile


def summarize_run(output: RunOutputLike, prefill_tokens_per_s: float) -> RunFigures:
    everything = output.results
    results = [r for r in everything if r.index >= output.warmup_requests]
    ok = [r for r in results if r.ok and r.ttft_ms is not None]
    answered = [r for r in results if r.ttft_ms is not None]  # a first token came (maybe no more)
    ttfts = [measured_ttft_ms(r) for r in results]
    node_regions = output.node_regions
    queries = sum(c["queries"] for c in output.node_counters.values())
    hits = sum(c["hits"] for c in output.node_counters.values())
    computed = queries - hits
    capacity = prefill_tokens_per_s * len(output.node_counters) * output.arrival_window_s
    per_node: dict[str, int] = dict.fromkeys(sorted(node_regions), 0)
    for result in ok:
        if result.node in per_node:
            per_node[result.node] += 1
    oracle = output.oracle_ms
    by_region: dict[str, RegionFigures] = {}
    for region in sorted({r.client_region for r in results}, key=_region_key):
        mine = [r for r in results if r.client_region == region]
        mine_ok = [r for r in ok if r.client_region == region]
        values = [measured_ttft_ms(r) for r in mine]
        served = [r for r in ok if r.node is not None and node_regions.get(r.node) == region]
        by_region[region] = RegionFigures(
            requests=len(mine),
            errors=len(mine) - len(mine_ok),
            ttft_p50_ms=ttft_percentile(values, 50),
            ttft_p90_ms=ttft_percentile(values, 90),
            ttft_p99_ms=ttft_percentile(values, 99),
            cross_region_share=_cross_share(mine_ok, node_regions),
            oracle_p50_ms=percentile(
                [oracle[r.index] for r in answered if r.client_region == region and r.index in oracle], 50
            ),
            served_from_abroad=(
                sum(1 for r in served if r.client_region != region) / len(served) if served else None
            ),
        )
    bounds = [oracle[r.index] for r in answered if r.index in oracle]
    return RunFigures(
        requests=len(results),
        warmup_requests=len(everything) - len(results),
        errors=sum(1 for r in everything if not (r.ok and r.ttft_ms is not None)),
        ttft_p50_ms=ttft_percentile(ttfts, 50) or 0.0,
        ttft_p90_ms=ttft_percentile(ttfts, 90) or 0.0,
        ttft_p99_ms=ttft_percentile(ttfts, 99) or 0.0,
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
        oracle_p50_ms=percentile(bounds, 50),
        oracle_p99_ms=percentile(bounds, 99),
        gorgo_lb=output.peer_state,
        attribution=attribute(ok, output.served),
        cut_after_first_token=sum(1 for r in everything if r.cut_after_first_token),
        ttfts_ms=ttfts,
    )


def attribute(ok: list[RequestResult], served: Mapping[int, Served]) -> dict[str, Any] | None:
    """Each request's TTFT split into RTT, queue, prefill and other, and its gap to the bound.

    Per request: ``ttft = rtt + intake + queue + prefill + lag + other``, where ``other`` is what
    the client measured beyond the node's own log and the network: the gateway's work, the loopback
    hops, the WAN emulator's jitter, the client's own lag. Its gap to the oracle bound splits the
    same way: ``rtt - bound rtt`` (a farther node than the bound's), all of ``intake``, ``queue``
    and ``lag`` (the bound has none), ``prefill - bound compute`` (less cached than the bound's
    node had, or prefill steps shared with a busy batch), and ``other``. Means add up, so the table gives means over the
    measured requests, and the same at the median (the requests between the TTFT's 45th and 55th
    percentiles), where p50 targets are decided.
    """
    rows = []
    for result in ok:
        at = served.get(result.index)
        if at is None or result.ttft_ms is None:
            continue
        other = result.ttft_ms - at.rtt_ms - at.intake_ms - at.queue_ms - at.prefill_ms - at.lag_ms
        bound = at.bound_rtt_ms + at.bound_compute_ms
        terms = (at.rtt_ms, at.intake_ms, at.queue_ms, at.prefill_ms, at.lag_ms, other)
        gap = (
            at.rtt_ms - at.bound_rtt_ms,
            at.intake_ms,
            at.queue_ms,
            at.prefill_ms - at.bound_compute_ms,
            at.lag_ms,
            other,
        )
        rows.append((result.ttft_ms, bound, terms, gap))
    if not rows:
        return None
    rows.sort(key=lambda row: row[0])
    last = len(rows) - 1  # the band by rank, so it is never empty: 45 % to 55 % of the way up
    middle = rows[math.floor(0.45 * last) : math.ceil(0.55 * last) + 1]

    def means(picked: list[Any]) -> dict[str, float]:
        count = len(picked)
        figures = {
            "ttft_ms": sum(row[0] for row in picked) / count,
            "bound_ms": sum(row[1] for row in picked) / count,
        }
        for position, term in enumerate(TERMS):
            figures[f"{term}_ms"] = sum(row[2][position] for row in picked) / count
            figures[f"gap_{term}_ms"] = sum(row[3][position] for row in picked) / count
        return figures

    return {"requests": len(rows), "mean": means(rows), "median_band": means(middle)}


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
        # Clients that hung up before their first byte (should be 0) ...
        "status_499": sum(1 for r in records if r.status == 499 and r.ttft_ms is None),
        # ... and after it: the harness stops reading answers once every request has its first
        # token (RequestResult.cut_after_first_token), and the gateway logs those as 499s.
        "status_499_after_first_byte": sum(1 for r in records if r.status == 499 and r.ttft_ms is not None),
        "routing_us_p50": percentile(routing_us, 50),
        "routing_us_p99": percentile(routing_us, 99),
        "index_predicted_hit_rate": predicted / estimated if estimated else None,
        "observed_hit_rate": cached / prompt if prompt else None,
        "records_with_matched_tokens": sum(
            1 for r in records if r.cost is not None and r.cost.matched_tokens > 0
        ),
        "gateway_ms_by_region": _gateway_ms_by_region(records),
    }


# A request that waited on a Redis round trip across the WAN spent at least half the shortest
# inter-region link (88 ms) in the gateway; nothing else in it takes that long on this fleet.
WAITED_ON_WAN_MS = 40.0


def _gateway_ms_by_region(records: list[RequestRecord]) -> dict[str, dict[str, float | int | None]]:
    """Time inside each region's gateway before a request left for its node (shared-state waits)."""
    by_region: dict[str, list[float]] = {}
    for record in records:
        if record.node_id is not None:
            by_region.setdefault(record.gateway_region, []).append(record.gateway_ms)
    return {
        region: {
            "p50": percentile(values, 50),
            "p99": percentile(values, 99),
            "max": max(values),
            "over_40ms": sum(1 for value in values if value >= WAITED_ON_WAN_MS),
        }
        for region, values in sorted(by_region.items(), key=lambda item: _region_key(item[0]))
    }


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        if not math.isfinite(value):
            return None  # JSON has no infinity: a percentile that fell on failed requests
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


# ---- across seeds -------------------------------------------------------------------------------

Runs = Mapping[str, Mapping[str, list[RunFigures]]]  # scenario -> policy -> one per seed


@dataclass(frozen=True)
class Spread:
    """A figure over seeds: the median and the range."""

    median: float
    low: float
    high: float

    def text(self, unit: str = "") -> str:
        if self.low == self.high:
            return f"{self.median:,.0f}{unit}"
        return f"{self.median:,.0f}{unit} ({self.low:,.0f}-{self.high:,.0f})"


def spread(values: list[float | None]) -> Spread | None:
    known = sorted(v for v in values if v is not None)
    if not known:
        return None
    middle = len(known) // 2
    median = known[middle] if len(known) % 2 else (known[middle - 1] + known[middle]) / 2
    return Spread(median, known[0], known[-1])


def over_seeds(figures: list[RunFigures], pick: Any) -> Spread | None:
    return spread([pick(f) for f in figures])


def _region_p50(region: str) -> Any:
    return lambda f: f.by_region[region].ttft_p50_ms if region in f.by_region else None


# ---- targets -----------------------------------------------------------------------------------


def evaluate_targets(runs: Runs) -> list[dict[str, Any]]:
    """The issue's targets, on the median over seeds, for the scenarios and policies that ran.

    Each: gorgo's figure, the figure it is held against, their ratio and the largest ratio allowed.
    "every other policy" is held by the best of the others at that figure; "the regional baseline"
    is the better of the two regional rows for that region's clients (the stricter comparison);
    gorgo-lb's rows have targets of their own too: "the best gorgo-lb", the best of its variants.
    """
    targets: list[dict[str, Any]] = []

    def add(scenario: str, name: str, gorgo_ms: float, against: str, against_ms: float, limit: float) -> None:
        if math.isinf(gorgo_ms) and math.isinf(against_ms):
            ratio = 1.0  # both percentiles fell on failed requests: neither is ahead
        else:
            ratio = gorgo_ms / against_ms if against_ms else float("inf")
        targets.append(
            {
                "workload": scenario,
                "target": name,
                "gorgo_ms": round(gorgo_ms, 1),
                "against": against,
                "against_ms": round(against_ms, 1),
                "ratio": round(ratio, 3),
                "limit_ratio": limit,
                "met": ratio <= limit,
            }
        )

    def best(policies: Mapping[str, list[RunFigures]], names: Any, pick: Any) -> tuple[str, float] | None:
        medians = {n: over_seeds(policies[n], pick) for n in names if n in policies}
        medians = {n: m.median for n, m in medians.items() if m is not None}
        if not medians:
            return None
        name = min(medians, key=medians.__getitem__)
        return name, medians[name]

    p50 = lambda f: f.ttft_p50_ms  # noqa: E731
    p99 = lambda f: f.ttft_p99_ms  # noqa: E731
    for scenario, policies in runs.items():
        if "gorgo" not in policies:
            continue
        gorgo = policies["gorgo"]
        g50 = over_seeds(gorgo, p50)
        g99 = over_seeds(gorgo, p99)
        assert g50 is not None and g99 is not None
        # Issue 24, item 3: the default is the best policy on every workload: its p50 at or below
        # every other policy's (global and regional baselines, gorgo@greedy, any other variant
        # that ran) and its p99 within 5 % of every other's; held against the best of them.
        others = [name for name in policies if name != "gorgo"]
        for pick, mine, limit, label in ((p50, g50, 1.0, "p50"), (p99, g99, 1.05, "p99")):
            other = best(policies, others, pick)
            if other:
                add(scenario, f"{label} <= {limit:g}x every other policy's", mine.median, *other, limit)
        # No region's own clients worse off than under the best regional baseline.
        regions = sorted({r for f in gorgo for r in f.by_region}, key=_region_key)
        for region in regions:
            regional = best(policies, REGIONAL, _region_p50(region))
            mine_region = over_seeds(gorgo, _region_p50(region))
            if regional and mine_region:
                add(
                    scenario,
                    f"{region} clients' p50 <= 1.05x the regional baseline",
                    mine_region.median,
                    *regional,
                    1.05,
                )
        if scenario in ("geo-chat", "diurnal", "four-region"):  # issue 24: the paper's own code
            for pick, mine, limit, label in ((p50, g50, 0.77, "p50"), (p99, g99, 0.9, "p99")):
                lb = best(policies, GORGO_LB, pick)
                if lb:
                    add(scenario, f"{label} <= {limit}x the best gorgo-lb", mine.median, *lb, limit)
        oracle = over_seeds(gorgo, lambda f: f.oracle_p50_ms)
        if oracle is not None:
            add(
                scenario,
                "p50 vs the oracle bound (<= 1.5x on geo-chat)",
                g50.median,
                "oracle",
                oracle.median,
                1.5 if scenario == "geo-chat" else float("inf"),
            )
    return targets


# ---- outputs -----------------------------------------------------------------------------------


def write_outputs(out: Path, meta: dict[str, Any], runs: Runs) -> list[Path]:
    targets = evaluate_targets(runs)
    document = {
        "meta": meta,
        "workloads": {
            scenario: {
                "rate_rps": meta["rates_rps"].get(scenario),
                "fleet": meta.get("fleets", {}).get(scenario),
                "policies": {
                    p: [figures.to_json() for figures in runs[scenario][p]]
                    for p in sorted(runs[scenario], key=_policy_key)
                },
            }
            for scenario in runs
        },
        "targets": [_rounded(t) for t in targets],  # an infinite limit (reported only): null
    }
    json_path = out.with_suffix(".json")
    json_path.write_text(json.dumps(_finite(document), indent=1, allow_nan=False) + "\n")
    md_path = out.with_suffix(".md")
    md_path.write_text(markdown(meta, runs, targets, out.with_suffix(".png").name))
    paths = [json_path, md_path]
    png_path = out.with_suffix(".png")
    if plot_cdfs(png_path, runs):
        paths.append(png_path)
    return paths


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float as None (JSON has no infinity), nothing else changed."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _spread_ms(value: Spread | None) -> str:
    return "-" if value is None else value.text()


def _fleet_lines(fleet: dict[str, Any]) -> list[str]:
    regions = fleet["regions"]
    shares = ", ".join(
        f"{region} {info['nodes']} node{'s' if info['nodes'] != 1 else ''}"
        + (f" / {info['client_share']:.0%} of clients" if info["client_share"] is not None else "")
        for region, info in regions.items()
    )
    rtts = ", ".join(f"{pair} {ms:g}" for pair, ms in fleet["rtt_ms"].items())
    speed, cache = fleet["prefill_tokens_per_s_per_node"], fleet["kv_capacity_tokens"]
    if isinstance(speed, dict) or isinstance(cache, dict):  # a fleet of mixed GPUs: node by node
        speeds = speed if isinstance(speed, dict) else dict.fromkeys(cache, speed)
        caches = cache if isinstance(cache, dict) else dict.fromkeys(speed, cache)
        engines = ", ".join(f"{node} {speeds[node]:,.0f} / {caches[node]:,}" for node in speeds)
        engine = f"Prefill tokens/s and KV cache tokens per node: {engines}."
    else:
        engine = f"Each node prefills {speed:,.0f} tokens/s with a {cache:,}-token KV cache."
    return [f"Fleet: `{fleet['topology']}`: {shares}. RTT ms: {rtts}. {engine}", ""]


def markdown(meta: dict[str, Any], runs: Runs, targets: list[dict[str, Any]], chart_name: str) -> str:
    seeds = meta.get("seeds", [])
    lines = [
        "# Routing quality",
        "",
        f"`{meta['command']}` on {meta['machine']}, {meta['date']}; {meta['duration_s']:.0f} s in all; "
        f"{meta['requests_per_run']:,} measured requests per run, seeds {', '.join(map(str, seeds))} "
        f"(every figure: median over the seeds, the range in brackets), answers of at most "
        f"{meta['max_tokens']} tokens. TTFT: request sent by the client to first content token, in ms. "
        "Every percentile counts every measured request: one that got no first token (refused, "
        "failed, cut off before it) counts as TTFT = inf, so failing a request never lowers a "
        "percentile; a figure shown as inf fell on such requests, and `errors` counts them (and "
        "those cut off after their first token, which count with the TTFT they had).",
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
        limit = t["limit_ratio"]
        if limit == float("inf"):
            verdict, allowed = "(reported)", "-"
        else:
            verdict = "yes" if t["met"] else f"**no** (by {t['ratio'] / limit - 1:.0%})"
            allowed = f"{limit:.2f}"
        lines.append(
            f"| {t['workload']} | {t['target']} | {_ms(t['gorgo_ms'])} | {t['against']} | "
            f"{_ms(t['against_ms'])} | {t['ratio']:.2f} | {allowed} | {verdict} |"
        )
    lines.append("")
    for scenario, policies in runs.items():
        order = sorted(policies, key=_policy_key)
        rate = meta["rates_rps"].get(scenario)
        lines += [f"## {scenario} ({rate:g} requests/s)", ""]
        fleet = meta.get("fleets", {}).get(scenario)
        if fleet:
            lines += _fleet_lines(fleet)
        lines += [
            "| policy | p50 | p99 | p50 / oracle p50 | prefix hit rate | cross-region | errors | prefill load | preemptions | client lag p99 |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for policy in order:
            runs_ = policies[policy]
            name = f"**{policy}**" if policy == "gorgo" else policy
            ratio = spread([f.ttft_p50_ms / f.oracle_p50_ms if f.oracle_p50_ms else None for f in runs_])
            lines.append(
                f"| {name} | {_spread_ms(over_seeds(runs_, lambda f: f.ttft_p50_ms))} | "
                f"{_spread_ms(over_seeds(runs_, lambda f: f.ttft_p99_ms))} | "
                f"{'-' if ratio is None else f'{ratio.median:.2f}x'} | "
                f"{_pct(over_seeds(runs_, lambda f: f.prefix_hit_rate * 100).median / 100)} | "
                f"{_pct(over_seeds(runs_, lambda f: f.cross_region_share * 100).median / 100)} | "
                f"{sum(f.errors for f in runs_)} | "
                f"{_pct(over_seeds(runs_, lambda f: f.prefill_utilization * 100).median / 100)} | "
                f"{sum(f.preemptions for f in runs_)} | "
                f"{_ms(max(f.send_lag_p99_ms for f in runs_))} |"
            )
        regions = sorted(
            {r for runs_ in policies.values() for f in runs_ for r in f.by_region}, key=_region_key
        )
        lines += [
            "",
            "TTFT p50 by client region (median over seeds; cross-region share of its requests):",
            "",
        ]
        lines.append("| policy | " + " | ".join(regions) + " |")
        lines.append("|---|" + "---:|" * len(regions))
        for policy in order:
            cells = []
            for region in regions:
                value = over_seeds(policies[policy], _region_p50(region))
                cross = spread(
                    [
                        f.by_region[region].cross_region_share * 100
                        if region in f.by_region and f.by_region[region].cross_region_share is not None
                        else None
                        for f in policies[policy]
                    ]
                )
                cells.append(f"{_spread_ms(value)} ({'-' if cross is None else f'{cross.median:.0f}%'})")
            lines.append(f"| {policy} | " + " | ".join(cells) + " |")
        lines += _displacement_lines(policies, regions)
        lines += _attribution_lines(policies, order)
        lines += _tuner_lines(policies)
        gorgo = policies.get("gorgo")
        if gorgo:
            lines += [
                "",
                "gorgo against the oracle bound, by client region (p50 / oracle p50, median over seeds):",
                "",
            ]
            cells = []
            for region in regions:
                ratio = spread(
                    [
                        f.by_region[region].ttft_p50_ms / f.by_region[region].oracle_p50_ms
                        if region in f.by_region
                        and f.by_region[region].ttft_p50_ms
                        and f.by_region[region].oracle_p50_ms
                        else None
                        for f in gorgo
                    ]
                )
                oracle = over_seeds(
                    gorgo,
                    lambda f, region=region: (
                        f.by_region[region].oracle_p50_ms if region in f.by_region else None
                    ),
                )
                cells.append(
                    "-"
                    if ratio is None or oracle is None
                    else f"{ratio.median:.2f}x (oracle {oracle.median:,.0f} ms)"
                )
            lines.append("| " + " | ".join(regions) + " |")
            lines.append("|" + "---:|" * len(regions))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    lines += _run_time_lines(runs)
    lines += [f"![TTFT CDFs per policy]({chart_name})", "", NOTES.strip(), ""]
    return "\n".join(lines)


# The phases of a run's wall clock (routing_quality.Phases, drive_phases), in the order they run.
PHASES = (
    ("plan", "plan"),
    ("fleet_reset", "fleet reset"),
    ("routers_start", "routers start"),
    ("arrivals", "arrivals"),
    ("to_last_first_token", "to last first token"),
    ("answer_tail", "answer tail"),
    ("after_answers", "scrapes, oracle"),
    ("records", "records"),
    ("teardown", "teardown"),
)


def _run_time_lines(runs: Runs) -> list[str]:
    """Where the wall clock went: seconds per run (mean over the seeds) per policy and phase."""
    lines: list[str] = []
    for scenario, policies in runs.items():
        timed = {p: [f.phases_s for f in runs_ if f.phases_s] for p, runs_ in policies.items()}
        timed = {p: phases for p, phases in timed.items() if phases}
        if not timed:
            continue
        lines += [
            f"## Run time: {scenario}",
            "",
            "Seconds per run, mean over the seeds (`total`: their sum; fleet reset: its start on a "
            "topology's first run; arrivals: the plan's last send; answer tail: after the last first "
            "token, 0 once the harness stops reading there).",
            "",
            "| policy | runs | total | " + " | ".join(label for _, label in PHASES) + " |",
            "|---|---:|---:|" + "---:|" * len(PHASES),
        ]
        total_s = 0.0
        for policy in sorted(timed, key=_policy_key):
            phases = timed[policy]
            means = [sum(ph.get(key, 0.0) for ph in phases) / len(phases) for key, _ in PHASES]
            run_s = sum(means)
            total_s += run_s * len(phases)
            cells = " | ".join(f"{value:.1f}" for value in means)
            lines.append(f"| {policy} | {len(phases)} | {run_s:.1f} | {cells} |")
        lines += ["", f"All runs: {total_s:.0f} s.", ""]
    return lines


def _displacement_lines(policies: Mapping[str, list[RunFigures]], regions: list[str]) -> list[str]:
    """Each region's own clients with and without the other regions' overflow.

    "Without": the regional baseline, where no region sends anything abroad. "With": gorgo (and
    the greedy variant), where the others may spill into it; "from abroad" is the share of what the
    region's nodes served that came from other regions' clients.
    """
    without = [p for p in REGIONAL if p in policies]
    with_ = [p for p in ("gorgo@greedy", "gorgo") if p in policies]
    if not without or not with_:
        return []
    lines = [
        "",
        "Displacement: each region's own clients' TTFT p50 with the other regions' overflow (gorgo) and "
        "without it (regional baselines); in brackets, the share of the region's nodes' requests that "
        "came from abroad:",
        "",
        "| policy | " + " | ".join(regions) + " |",
        "|---|" + "---:|" * len(regions),
    ]
    for policy in [*without, *with_]:
        cells = []
        for region in regions:
            value = over_seeds(policies[policy], _region_p50(region))
            abroad = spread(
                [
                    f.by_region[region].served_from_abroad * 100
                    if region in f.by_region and f.by_region[region].served_from_abroad is not None
                    else None
                    for f in policies[policy]
                ]
            )
            cells.append(f"{_spread_ms(value)} ({'-' if abroad is None else f'{abroad.median:.0f}%'})")
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    return lines


def _attribution_lines(policies: Mapping[str, list[RunFigures]], order: list[str]) -> list[str]:
    """Where each policy's TTFT goes, and what separates it from the oracle bound (``attribute``)."""
    rows = [policy for policy in order if any(f.attribution for f in policies[policy])]
    if not rows:
        return []
    lines = [
        "",
        "Where the time goes (``attribute``: per measured request, TTFT = RTT + intake (the emulated "
        "node reading, parsing and tokenizing it) + queue at the node + prefill to the first token + "
        "lag (how late the emulator's busy process wrote that token out) + other (gateway, hops, "
        "jitter, the client's own lag); intake and lag are this harness's costs on a shared machine. "
        "Its gap to the oracle bound splits the same way: the bound has no intake, queue or lag, and "
        "its node's RTT and cache are the best the fleet had). "
        "Means in ms over the requests at the median (45th to 55th percentile of TTFT) and, after the "
        "slash, over all measured requests; medians over seeds:",
        "",
        "| policy | TTFT | bound | RTT | intake | queue | prefill | lag | other | gap: RTT | gap: prefill |",
        "|---|" + "---:|" * 10,
    ]
    # The gap's intake, queue, lag and other are the terms themselves (the bound has none of them).
    columns = ("ttft_ms", "bound_ms", *(f"{t}_ms" for t in TERMS), "gap_rtt_ms", "gap_prefill_ms")
    for policy in rows:
        cells = []
        for column in columns:
            band = over_seeds(
                policies[policy],
                lambda f, c=column: f.attribution["median_band"][c] if f.attribution else None,
            )
            mean = over_seeds(
                policies[policy], lambda f, c=column: f.attribution["mean"][c] if f.attribution else None
            )
            cells.append("-" if band is None or mean is None else f"{band.median:,.0f} / {mean.median:,.0f}")
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    return lines


TUNED_WEIGHTS = ("rtt_weight", "prefill_weight")  # gorgo.tuner.HYPERPARAM_RANGES


def _tuner_lines(policies: Mapping[str, list[RunFigures]]) -> list[str]:
    """What gorgo-lb's own ES tuner did in each run: the weights each adapter ended with."""
    rows = []
    for policy in sorted(policies, key=_policy_key):
        for seed_index, figures in enumerate(policies[policy], start=1):
            for region, state in (figures.gorgo_lb or {}).items():
                if state.get("tuner_steps"):
                    weights = ", ".join(f"{k} {state['weights'][k]:g}" for k in TUNED_WEIGHTS)
                    rows.append(
                        f"| {policy} | {seed_index} | {region} | {weights} | {state['tuner_steps']} "
                        f"({state['tuner_accepted']} accepted{', converged' if state['tuner_converged'] else ''}) |"
                    )
    if not rows:
        return []
    return [
        "",
        "gorgo-lb's ES tuner (package defaults: p95 TTFT objective, searching rtt_weight and prefill_weight from 1;"
        " load_weight stays 1; a step every 10 of an adapter's requests over the last 20): the weights each"
        " adapter ended the run with:",
        "",
        "| policy | run | adapter | weights at the end | tuner steps |",
        "|---|---:|---|---|---|",
        *rows,
    ]


def plot_cdfs(path: Path, runs: Runs) -> bool:
    """One subplot per scenario: the TTFT CDF of every policy, seeds pooled (log time axis); a
    policy's failed requests never reach a first token, so its curve ends below 1 by their share."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    scenarios = list(runs)
    if not scenarios:
        return False
    figure, axes = plt.subplots(1, len(scenarios), figsize=(5.2 * len(scenarios), 4.2), squeeze=False)
    for axis, scenario in zip(axes[0], scenarios, strict=True):
        for policy in sorted(runs[scenario], key=_policy_key):
            pooled = [v for f in runs[scenario][policy] for v in f.ttfts_ms]
            # Failed requests (+inf) stay in the denominator: the curve tops out below 1.
            values = sorted(v for v in pooled if math.isfinite(v))
            if not values:
                continue
            fractions = [(index + 1) / len(pooled) for index in range(len(values))]
            axis.step(
                values,
                fractions,
                where="post",
                label=policy,
                color=COLORS.get(policy),
                linewidth=2.2 if policy == "gorgo" else 1.3,
            )
        axis.set_xscale("log")
        axis.set_title(scenario)
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

- **Fleets.** Each scenario names its topology file (above each table; `--topology` replaces it):
  the default three regions (us-east, eu-central, ap-south; two nodes each; RTTs 88, 120 and
  235 ms, 1.5 ms inside a region) or `four-region-short.toml` (us-west, eu-west, ap-northeast with
  one node, sa-east; ap-northeast's nearest neighbour us-west 100 ms away). Every node prefills
  10,638 tokens/s (the GORGO paper's 0.094 ms/token), decodes as the emulated H100 and holds
  2,048 KV blocks of 16 tokens (32,768 tokens, so caches evict). A fresh fleet per run.
- **Policies.** Global baselines route over every region: `least_load`, `prefix_affinity`
  (SGLang's cache-aware policy) and the Rust `vllm-router` (`cache_aware`, one per region over all
  nodes, through the nodes' per-region ports so it pays the same WAN). The regional baseline is what
  operators deploy today, geo-DNS plus a cache-aware router per region over its own nodes:
  `vllm-router@local` (one per region over that region's nodes; geo-DNS failover repoints the
  region's clients to the nearest other region's router while its nodes are down, through a
  delay proxy at the RTT between the two regions) and
  `prefix_affinity@local` (gorgo's gateways, `scope: local`: abroad only when no local node is
  healthy). `gorgo` runs with its defaults (which price the wait a forward adds for the receiving
  region's clients); `gorgo@greedy` leaves that out (`w_displacement` 0), on the overflow
  scenarios only.
- **gorgo-lb.** The GORGO paper's own router (PyPI `gorgo-lb`) behind `benchmarks/gorgo_lb_peer.py`,
  one per region (or one central proxy whose far clients pay their RTT to it), fed gorgo's inputs:
  the RTT table, queued tokens (its own counter, or the nodes' `/metrics` every 5 s when that shows
  more), the emulator's token ids for its radix trie, the prefill speed where the policy takes it.
  benchmarks/README.md lists the variants.
- **Traffic.** `simulator.traffic` plans, seeded (the seeds above), the same arrivals for every
  policy; clients send to their own region's gateway or router; streamed answers of at most 128
  tokens; TTFT from sending the request to the first content token. The first 10 % of arrivals warm
  the caches and are not counted. Rates: 7 requests/s per node for geo-chat and region-outage (the
  rate at which the cache-oblivious least_load offered ~65 % of the prefill capacity, calibrated on
  the three-region fleet); diurnal at the rate that puts the peak region (80 % of the clients in
  its phase) at 2x what its nodes can prefill (unique 1k-3k-token prompts), the other regions
  nearly idle. region-outage stops the first region's nodes from 30 % to 60 % of the run through
  the simulator's fault API; the routers learn it 1 s later (gateways: the nodes' live state turns
  unhealthy, as telemetry's health check writes it; the regional vllm-router: DNS failover).
- **Oracle.** As each request reaches the fleet, the simulator computes the fastest first token
  any node could give it: RTT from the client's region + one engine step + the prefill of what
  that node does not hold in its KV cache at that moment, no queue. It depends on where the policy
  put earlier prompts (the caches are the policy's own), so each row has its own oracle; "p50 /
  oracle p50" is the ratio of the two medians. A lower bound, not a target: no router avoids every
  queue.
- **Harness.** Everything (fleet, gateways or routers, Redis, the client) shares this machine's
  2 vCPUs with other work; "client lag p99" is how late the client sent first turns against the
  plan (a check that the machine itself was not the bottleneck). Each figure is the median over the
  seeds, with the range.

## Reading the results

- **geo-chat, even load**: the regional baseline keeps every request local and cache-aware, which
  is close to what gorgo does; the global baselines pay cross-region RTTs on most requests.
- **diurnal**: the peak region gets twice what its nodes can prefill; kept at home (regional
  baseline) its queue grows for the whole phase. gorgo spills the excess to the idle regions.
- **four-region**: the short region (one node, 40 % of the clients) queues under the regional
  baseline; the other 60 % of the clients are local and fast under both, so the overall p50 is
  theirs, and the gain shows at p99 and in the short region's own row.
- **region-outage**: everyone fails over; the difference is where and how fast.
- **Displacement**: each region's own clients with the others' overflow (gorgo) against without
  it (regional baselines, nothing crosses a border).

Targets that are not met say by how much in the Targets table; docs/routing.md discusses why.
"""
