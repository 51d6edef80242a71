"""What-if accuracy and speed: replay a recorded live run and compare predicted with measured TTFT.

    python benchmarks/whatif_accuracy.py             # ~3 min; needs Redis at REDIS_URL
    python benchmarks/whatif_accuracy.py --quick     # ~1 min smoke run into var/

1. **Record.** The emulated three-region fleet (``simulator/topologies/default.toml``, the routing
   quality benchmark's engine settings) behind one real gateway per region running the live
   policy (gorgo with its defaults), driven by a seeded geo-chat plan (multi-turn chats over long
   regional system prompts). The gateways log every request to the request stream, with its prefix
   hashes, as the control plane's what-if reads it.
2. **Replay.** The same records (``simulator.replay.to_replay_requests``, as the what-if API
   builds them) through the same policy on the emulated fleet in virtual time
   (``simulator.replay.replay``), with the RTT table the gateways routed by, no live state (this
   run has no telemetry workers, like the gateways it replays).
3. **Compare** predicted with measured TTFT (the gateway's ``ttft_ms``: arrival to first byte back,
   what the replay predicts), p50/p90/p99 and mean, over the requests after a 10 % warm-up; and
   time a replay of 10,000 requests (the recorded run's arrivals repeated, so the load is the
   same) for the API's budget.

Results: benchmarks/results/whatif_accuracy.{json,md} (``--out`` to write elsewhere).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import sys
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path

import redis
from routing_quality import (  # this directory is on sys.path
    MAX_TOKENS,
    delete_namespace,
    node_specs,
    publish_policy,
    start_fleet,
    start_gateways,
)

from routing.contract import PolicySnapshot, RedisKeys, RequestRecord, RTTTable, decode
from simulator.harness import exit_on_sigterm
from simulator.replay import percentile, replay, replayable, rtt_pairs, to_replay_requests
from simulator.topology import DEFAULT_TOPOLOGY_PATH, load_topology
from simulator.traffic import build_plan, run_plan

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
WARMUP_SHARE = 0.1
TIMED_REQUESTS = 10_000
DEFAULT_RATE_RPS = 12.0


def measure(ttfts: list[float]) -> dict[str, float | None]:
    values = sorted(ttfts)
    return {
        "count": len(values),
        "p50_ms": percentile(values, 50),
        "p90_ms": percentile(values, 90),
        "p99_ms": percentile(values, 99),
        "mean_ms": sum(values) / len(values) if values else None,
    }


def record_run(
    requests: int, rate: float, seed: int, redis_url: str, workdir: Path
) -> tuple[list[RequestRecord], PolicySnapshot, RTTTable]:
    topology = load_topology(DEFAULT_TOPOLOGY_PATH)
    regions = [region.slug for region in topology.regions]
    plan = build_plan(
        "geo-chat",
        regions,
        rate_rps=rate,
        duration_s=requests / rate * 1.5,
        max_requests=requests,
        seed=seed,
        max_tokens=MAX_TOKENS,
    )
    fleet = start_fleet(workdir, DEFAULT_TOPOLOGY_PATH)
    procs = [fleet.proc]
    client = redis.Redis.from_url(redis_url)
    keys = RedisKeys(prefix=f"gorgobench-wi-{uuid.uuid4().hex[:12]}")
    try:
        nodes = node_specs(topology, fleet)
        publish_policy(client, keys, topology, nodes, "gorgo")
        snapshot = decode(client.get(keys.policy_current), PolicySnapshot)
        table = decode(client.get(keys.live_rtt), RTTTable)
        gateways, targets = start_gateways(workdir, regions, redis_url, keys.prefix)
        procs += gateways
        asyncio.run(run_plan(plan, targets, stream=True, request_timeout_s=120.0, drain_timeout_s=60.0))
        time.sleep(0.3)  # the gateways flush their request logs every 50 ms
        records = [decode(fields[b"r"], RequestRecord) for _, fields in client.xrange(keys.request_stream)]
        return records, snapshot, table
    finally:
        for proc in reversed(procs):
            proc.stop()
        delete_namespace(client, keys.prefix)
        client.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1200, help="recorded requests (1200)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--rate",
        type=float,
        default=DEFAULT_RATE_RPS,
        help=f"arrivals per second ({DEFAULT_RATE_RPS:g}: what this shared 2-core machine drives without "
        "the emulator and load generator falling behind; routing_quality.py uses 42)",
    )
    parser.add_argument("--quick", action="store_true", help="300 requests, output into var/")
    parser.add_argument("--out", type=Path, default=None, help="output path without extension")
    args = parser.parse_args(argv)
    exit_on_sigterm()  # a kill stops what this started
    requests = 300 if args.quick else args.requests
    out = args.out or (ROOT / "var" / "whatif_accuracy_quick" if args.quick else RESULTS / "whatif_accuracy")
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="gorgo-whatif-") as workdir:
        records, snapshot, table = record_run(requests, args.rate, args.seed, redis_url, Path(workdir))
    records.sort(key=lambda r: r.ts)
    replayed = to_replay_requests(records)
    outcome = replay(snapshot, rtt_pairs(table), replayed, scrape_interval_s=None, wall_budget_s=600.0)
    kept = [r for r in records if replayable(r)]
    warm = round(len(kept) * WARMUP_SHARE)
    measured = [r.ttft_ms for r in kept[warm:] if r.ttft_ms is not None]
    predicted = [p.ttft_ms for p in outcome.requests[warm:] if p.ttft_ms is not None]
    same_node = sum(1 for r, p in zip(kept, outcome.requests, strict=True) if r.node_id == p.node_id) / len(
        kept
    )

    # Speed: 10,000 requests at the recorded load (the run's arrivals repeated back to back).
    span_s = replayed[-1].arrival_s + 1.0
    count = len(replayed)
    many = [
        replace(replayed[i % count], arrival_s=replayed[i % count].arrival_s + span_s * (i // count))
        for i in range(TIMED_REQUESTS)
    ]
    cpu_before = resource.getrusage(resource.RUSAGE_SELF).ru_utime
    timed = replay(snapshot, rtt_pairs(table), many, scrape_interval_s=5.0, wall_budget_s=600.0)
    cpu_s = resource.getrusage(resource.RUSAGE_SELF).ru_utime - cpu_before

    measured_figures, predicted_figures = measure(measured), measure(predicted)
    error = {
        name: (predicted_figures[name] - measured_figures[name]) / measured_figures[name]
        for name in ("p50_ms", "p90_ms", "p99_ms", "mean_ms")
        if measured_figures[name] and predicted_figures[name] is not None
    }
    result = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": f"{platform.platform()}, Python {platform.python_version()}, {os.cpu_count()} CPUs",
        "workload": "geo-chat",
        "topology": "default.toml",
        "policy": "gorgo (defaults)",
        "seed": args.seed,
        "recorded_requests": len(records),
        "replayed_requests": len(replayed),
        "warmup": warm,
        "with_prefix_hashes": sum(1 for r in replayed if r.prefix_hashes) / len(replayed),
        "measured": measured_figures,
        "predicted": predicted_figures,
        "relative_error": error,
        "same_node_share": same_node,
        "unfinished": outcome.unfinished,
        "unroutable": outcome.unroutable,
        "replay_wall_s": outcome.wall_s,
        "speed": {
            "requests": TIMED_REQUESTS,
            "wall_s": timed.wall_s,
            "cpu_s": cpu_s,
            "virtual_s": timed.virtual_s,
        },
        "total_s": time.time() - started,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(report(result))
    print(report(result))
    return 0


def report(r: dict) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:,.0f}"

    rows = "\n".join(
        f"| {name[:-3]} | {ms(r['measured'][name])} | {ms(r['predicted'][name])} | "
        f"{r['relative_error'].get(name, 0.0) * 100:+.0f} % |"
        for name in ("p50_ms", "p90_ms", "p99_ms", "mean_ms")
    )
    speed = r["speed"]
    return f"""# What-if replay: accuracy and speed

`python benchmarks/whatif_accuracy.py` on {r["machine"]}, {r["when"]}; {r["total_s"]:.0f} s in all.

A recorded live run: {r["recorded_requests"]} requests of the `{r["workload"]}` workload (seed {r["seed"]}) through
one real gateway per region running `{r["policy"]}` on the emulated fleet (`{r["topology"]}`). The same
records ({r["with_prefix_hashes"] * 100:.0f} % with prefix hashes) replayed through the same policy on the emulated fleet in virtual
time (`simulator/replay.py`), as the what-if API does. TTFT in ms, the gateway's (arrival to first
byte back), over the {r["replayed_requests"] - r["warmup"]} requests after a {r["warmup"]}-request warm-up:

| TTFT | measured (recorded run) | predicted (replay) | error |
|---|---:|---:|---:|
{rows}

The replay sent {r["same_node_share"] * 100:.0f} % of the requests to the node the live gateways chose; {r["unfinished"]} unfinished,
{r["unroutable"]} unroutable. The replay of this run took {r["replay_wall_s"]:.1f} s.

**Speed**: {speed["requests"]:,} requests (the run's arrivals repeated, {speed["virtual_s"]:.0f} s of traffic) replayed in
{speed["wall_s"]:.1f} s of wall time ({speed["cpu_s"]:.1f} s of CPU) on this shared machine, per policy; the what-if
replays two (draft and live).

What the replay leaves out, and so where its errors come from: gateways share their in-flight load
and prefix insertions through Redis with a delay (the replay shares them instantly); the node's
HTTP server, tokenisation and the relay of the first chunk (the replay adds only the recorded
gateway time and the RTT); WAN jitter per request (the replay uses the table's mean); the emulated
engine's own step clock drifting behind under load on a busy machine.
"""


if __name__ == "__main__":
    sys.exit(main())
