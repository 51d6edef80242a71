"""The shadow's CPU cost per request (issue 23): the routing decision with a shadow on vs off. In-process.

    python benchmarks/shadow_cost.py                 # from the repo root; ~20 s, bounded

With a shadow in the snapshot, every request costs the gateway one more routing decision: the
shadow's algorithm on the same ``RoutingView`` (``routing.proxy.shadow.shadow_decision``), plus
pricing the chosen nodes with the GORGO cost model when an algorithm prices nothing. Measured side
by side, alternating request by request so both see the same machine load:

- ``off``: build the ``RoutingView`` and run the live policy's ``choose`` (what ``_route`` does
  besides the prefix index, which a shadow does not change when the live policy already uses it);
- ``on``: what ``_route`` does with a shadow: ``decide_with_shadow`` (a second ``choose`` on the same
  view, or, for a gorgo shadow that only moves the weights, gorgo's per-node terms weighed twice).

The tables are built by the gateway's own ``build_table`` from snapshots made by
``simulator.snapshots`` (nodes in three regions, measured RTTs, some load and some cached prefix
per node), for the default emulated fleet (6 nodes) and larger ones (16, 64), and three pairs of
policies. Writes benchmarks/results/shadow_cost.{json,md}. The issue's budget: at most 10 us of
gateway CPU per request at p50.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from routing.algorithms import REGISTRY  # noqa: E402
from routing.algorithms.base import NodeLoad, RoutingRequest, RoutingView  # noqa: E402
from routing.contract import (  # noqa: E402
    GorgoParams,
    LeastLoadParams,
    PolicySpec,
    PrefixAffinityParams,
    TrialSpec,
    algorithm_name,
)
from routing.proxy.shadow import decide_with_shadow  # noqa: E402
from routing.state.table import build_table  # noqa: E402
from simulator.snapshots import MODEL, make_node, make_snapshot  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
REGIONS = ("us-east", "eu-central", "ap-south")
RTT_MS = {"us-east": 1.5, "eu-central": 88.0, "ap-south": 235.0}  # from us-east, default topology
BUDGET_US = 10.0
PAIRS = (
    ("gorgo", GorgoParams(), "gorgo w_rtt=0", GorgoParams(w_rtt=0.0)),
    ("least_load", LeastLoadParams(), "gorgo", GorgoParams()),
    ("gorgo", GorgoParams(), "prefix_affinity", PrefixAffinityParams()),
)


def case(nodes_count: int, live_params, shadow_params, rng: random.Random):
    nodes = tuple(make_node(i + 1, region=REGIONS[i % 3]) for i in range(nodes_count))
    shadow = TrialSpec(
        id=1,
        kind="shadow",
        policy=PolicySpec(
            id=2, name="shadow", algorithm=algorithm_name(type(shadow_params)), params=shadow_params
        ),
    )
    rtt = {node.id: RTT_MS[node.region] for node in nodes}
    table = build_table(make_snapshot(nodes, params=live_params, shadow=shadow), "us-east", REGISTRY, {}, rtt)
    assert table.shadow is not None
    load = {node.id: NodeLoad(rng.randint(0, 12), rng.randint(0, 20_000)) for node in nodes}
    matched = {node.id: rng.choice((0, 0, 512, 2048)) for node in nodes}
    request = RoutingRequest(MODEL, 8_000, 2_000, None)
    return table, load, matched, request


def measure(nodes_count: int, pair, iterations: int, rng: random.Random) -> dict:
    live_name, live_params, shadow_name, shadow_params = pair
    table, load, matched, request = case(nodes_count, live_params, shadow_params, rng)
    candidates = table.candidates[MODEL]
    choose = table.algorithm.choose
    shadow = table.shadow
    params = table.snapshot.policy.params
    # This thread's CPU time, not the wall clock: the budget is CPU, and on a shared machine the
    # wall clock also counts the time other processes held the core.
    clock = time.thread_time_ns

    def off(sequence: int) -> int:
        start = clock()
        view = RoutingView(
            table.region, candidates, params, load, table.rtt_ms, table.live, matched, sequence, "gw"
        )
        choose(view, request)
        return clock() - start

    def on(sequence: int) -> int:
        start = clock()
        view = RoutingView(
            table.region, candidates, params, load, table.rtt_ms, table.live, matched, sequence, "gw"
        )
        decide_with_shadow(table.algorithm, shadow, view, request, live_view=True)
        return clock() - start

    for sequence in range(500):  # warm up
        off(sequence)
        on(sequence)
    gc.collect()
    gc.disable()
    try:
        off_ns, on_ns = [], []
        for sequence in range(iterations):
            off_ns.append(off(sequence))
            on_ns.append(on(sequence))
    finally:
        gc.enable()
    off_p50 = statistics.median(off_ns) / 1000
    on_p50 = statistics.median(on_ns) / 1000
    return {
        "nodes": nodes_count,
        "live": live_name,
        "shadow": shadow_name,
        "off_p50_us": round(off_p50, 2),
        "on_p50_us": round(on_p50, 2),
        "shadow_p50_us": round(on_p50 - off_p50, 2),
        "off_p99_us": round(statistics.quantiles(off_ns, n=100)[98] / 1000, 2),
        "on_p99_us": round(statistics.quantiles(on_ns, n=100)[98] / 1000, 2),
    }


def main() -> None:
    rng = random.Random(23)
    iterations = int(os.environ.get("SHADOW_COST_ITERATIONS", "5000"))
    rows = [measure(nodes, pair, iterations, rng) for nodes in (6, 16, 64) for pair in PAIRS]
    machine = f"{platform.platform()}, Python {platform.python_version()}, {os.cpu_count()} CPUs"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "shadow_cost.json").write_text(
        json.dumps(
            {"machine": machine, "iterations": iterations, "budget_us": BUDGET_US, "rows": rows}, indent=2
        )
        + "\n"
    )
    lines = [
        "# The shadow's CPU cost per request",
        "",
        f"`python benchmarks/shadow_cost.py` on {machine}; {iterations:,} decisions per row, shadow on and "
        "off alternating, timed on this thread's CPU clock. One decision = `RoutingView` + the live `choose`; with the shadow on, "
        "`decide_with_shadow` instead of `choose` (the shadow's `choose` on the same view and GORGO pricing where an "
        "algorithm prices nothing; a gorgo shadow that only moves the weights re-weighs the live decision's terms). "
        f"Budget: shadow p50 <= {BUDGET_US:g} us.",
        "",
        "| nodes | live | shadow | off p50 us | on p50 us | shadow p50 us | off p99 us | on p99 us |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['nodes']} | {row['live']} | {row['shadow']} | {row['off_p50_us']} | {row['on_p50_us']} | "
            f"**{row['shadow_p50_us']}** | {row['off_p99_us']} | {row['on_p99_us']} |"
        )
    (RESULTS / "shadow_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
