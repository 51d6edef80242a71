"""Does compiling the hot modules (routing/native.py, mypyc) pay, and what did the per-request work
moved off the path (lock-free metrics, deferred request records) save? Rounds taken in turns.

    python benchmarks/hotpath.py [--rounds 5] [--seconds 4]     # from the repo root; needs wrk

In-process, in fresh subprocesses alternating pure Python (``GORGO_PURE_PYTHON=1``) and compiled:

- ``decision``: ``RoutingView`` + ``gorgo.choose`` over 3 nodes (the benchmark fleet) and over 64
  (the routing_decision.py fleet's size), with load, RTTs and prefix matches;
- ``front_door``: ``authenticate`` + ``admit`` + ``done`` for a key with limits, the rate limiter
  served from its lease (real Redis at ``REDIS_URL``), minus the header scan alone (as
  benchmarks/front_door_cpu.py).

End to end: three mock nodes and three gateways side by side (front door on, ``gorgo``, request
log on): ``main`` (the checkout at ``--main``, before this change), ``pure`` and ``compiled`` (this
tree, with and without ``GORGO_PURE_PYTHON=1``), each round ``wrk -c32`` against each in turn; CPU
per request from /proc. Writes benchmarks/results/hotpath.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import gateway_overhead as bench  # this directory is on sys.path when run as a script

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


# ---- in-process rows (run in a child process: the import decides pure or compiled) ----------------


def _decision_us(nodes_count: int, iterations: int) -> float:
    import random

    from routing.algorithms import gorgo
    from routing.algorithms.base import NodeLoad, RoutingRequest, RoutingView
    from routing.contract import GorgoParams
    from simulator.snapshots import make_node

    rng = random.Random(7)
    regions = ("us-east", "eu-west", "ap-south")
    nodes = tuple(
        make_node(
            node_id,
            f"http://127.0.0.1:{8100 + node_id}",
            region=regions[node_id % 3],
            models=("m",),
            max_num_seqs=256,
            prefill_tokens_per_s=20_000.0,
            kv_capacity_tokens=448_000,
        )
        for node_id in range(1, nodes_count + 1)
    )
    load = {node.id: NodeLoad(rng.randint(0, 40), rng.randint(0, 30_000)) for node in nodes}
    rtt_ms = {node.id: rng.uniform(0.5, 80.0) for node in nodes}
    matched = {node.id: rng.randint(0, 2_000) for node in nodes[: max(1, nodes_count // 3)]}
    params = GorgoParams()
    request = RoutingRequest("m", 8_000, 2_000)
    start = time.perf_counter()
    for sequence in range(iterations):
        view = RoutingView("us-east", nodes, params, load, rtt_ms, {}, matched, sequence, "bench")
        gorgo.choose(view, request)
    return (time.perf_counter() - start) / iterations * 1e6


async def _front_door_us(iterations: int) -> float:
    from front_door_cpu import make_front_door

    from routing.http.headers import scan_request_headers

    door, redis, keys, headers, usage = make_front_door()
    try:
        for _ in range(2):  # the first lease comes from Redis: warm up past it
            found = scan_request_headers(headers, None, keep_credentials=False)
            client_key = door.authenticate(found)
            door.done(client_key, await door.admit(client_key, "m", 12), usage, 200)
        start = time.perf_counter()
        for _ in range(iterations):
            found = scan_request_headers(headers, None, keep_credentials=False)
            client_key = door.authenticate(found)
            grant = await door.admit(client_key, "m", 12)
            door.done(client_key, grant, usage, 200)
        with_door = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(iterations):
            scan_request_headers(headers, None)
        scan = time.perf_counter() - start
    finally:
        await redis.delete(keys.rate_limit("bench"))
        await redis.aclose()
    return (with_door - scan) / iterations * 1e6


def child(iterations: int) -> None:
    import asyncio

    from routing import native

    figures = {
        "decision_3_nodes_us": _decision_us(3, iterations),
        "decision_64_nodes_us": _decision_us(64, max(1, iterations // 10)),
        "front_door_us": asyncio.run(_front_door_us(iterations)),
        "compiled_modules": len(native.loaded()),
    }
    print(json.dumps(figures))


def in_process(rounds: int, iterations: int) -> dict[str, Any]:
    samples: dict[str, dict[str, list[float]]] = {"pure": {}, "compiled": {}}
    loaded: dict[str, int] = {}
    for _ in range(rounds):
        for label in ("pure", "compiled"):
            env = {**os.environ, "GORGO_PURE_PYTHON": "1" if label == "pure" else "0"}
            out = subprocess.run(
                [sys.executable, __file__, "--child", "--iterations", str(iterations)],
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
                check=True,
            ).stdout
            figures = json.loads(out.strip().splitlines()[-1])
            loaded[label] = figures.pop("compiled_modules")
            for name, value in figures.items():
                samples[label].setdefault(name, []).append(value)
    rows = {}
    for name in samples["pure"]:
        pure, compiled = samples["pure"][name], samples["compiled"][name]
        ratios = [c / p for p, c in zip(pure, compiled, strict=True)]
        rows[name] = {
            "pure_us": round(statistics.median(pure), 3),
            "compiled_us": round(statistics.median(compiled), 3),
            "compiled_over_pure": round(statistics.median(ratios), 3),
            "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
        }
    return {"rows": rows, "compiled_modules_loaded": loaded}


# ---- end to end ---------------------------------------------------------------------------------


def end_to_end(rounds: int, seconds: float, main_checkout: Path | None) -> dict[str, Any]:
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    workdir = Path(tempfile.mkdtemp(prefix="gorgo-hotpath-"))
    mocks = bench.start_mocks(workdir)
    prefix = f"gorgohot-{uuid.uuid4().hex[:12]}"
    bench._publish_policy(redis_url, prefix, [f"http://127.0.0.1:{m.port}" for m in mocks], "gorgo")
    bench._publish_bench_key(redis_url, prefix)
    base_env = {
        "REDIS_URL": redis_url,
        "GORGO_REDIS_PREFIX": prefix,
        "LOG_LEVEL": "info",
        "GORGO_AUTH": "on",
    }
    variants: dict[str, tuple[list[str], dict[str, str], Path]] = {
        "pure": ([sys.executable], {"GORGO_PURE_PYTHON": "1"}, ROOT),
        "compiled": ([sys.executable], {"GORGO_PURE_PYTHON": "0"}, ROOT),
    }
    if main_checkout is not None:
        python = main_checkout / ".venv" / "bin" / "python"
        variants = {"main": ([str(python)], {}, main_checkout), **variants}
    gateways = {}
    try:
        for label, (python, env, cwd) in variants.items():
            gateways[label] = bench._start(
                f"gateway-{label}",
                # -P: not the working directory (this tree) first on sys.path, but PYTHONPATH's
                # checkout, so `main` runs main's code.
                [*python, "-P", "-m", "routing", "--port", "0", "--region", "bench"],
                workdir,
                {**base_env, **env, "PYTHONPATH": str(cwd)},
                port_pattern=r"(?:running|listening) on http://127\.0\.0\.1:(\d+)",  # uvicorn or the own server
            )
        for gateway in gateways.values():
            bench.latency_c1(gateway.port, 500, 100, auth=bench.BENCH_SECRET)
        samples: dict[str, dict[str, list[float]]] = {label: {} for label in gateways}
        for _ in range(rounds):
            for label, gateway in gateways.items():
                pid = gateway.process.pid
                cpu_before = bench.group_cpu_s(pid)
                rps, done, _ = bench.throughput_c32(gateway.port, seconds, auth=bench.BENCH_SECRET)
                cpu_us = (bench.group_cpu_s(pid) - cpu_before) / max(done, 1) * 1e6
                samples[label].setdefault("cpu_us_per_request", []).append(cpu_us)
                samples[label].setdefault("requests_per_s_c32", []).append(rps)
                samples[label].setdefault("requests_per_core_s", []).append(1e6 / cpu_us)
                latencies = bench.latency_c1(gateway.port, 400, 50, auth=bench.BENCH_SECRET)
                samples[label].setdefault("p50_ms_c1", []).append(bench._percentile(latencies, 50))
    finally:
        for gateway in gateways.values():
            gateway.stop()
        for mock in mocks:
            mock.stop()
        bench._redis_cleanup(redis_url, prefix)
    rows: dict[str, Any] = {}
    for label, figures in samples.items():
        rows[label] = {name: round(statistics.median(values), 3) for name, values in figures.items()}
        rows[label]["cpu_us_per_request_rounds"] = [round(v, 1) for v in figures["cpu_us_per_request"]]
    reference = samples["pure"]["cpu_us_per_request"]
    for label in samples:
        ratios = [v / r for v, r in zip(samples[label]["cpu_us_per_request"], reference, strict=True)]
        rows[label]["cpu_over_pure"] = round(statistics.median(ratios), 3)
        rows[label]["cpu_over_pure_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
    return rows


def _markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Hot path: compiled vs pure Python, and the per-request work moved off the path",
        "",
        f"{report['generated_at']}, {report['machine']['load']}. `python benchmarks/hotpath.py` "
        f"({report['method']}) at {report.get('commit', '?')}; `main` is {report.get('main_commit', 'not run')}, "
        "the commit this change started from.",
        "",
        "## In-process (µs per call, median of rounds; ratio = compiled / pure, per round)",
        "",
        "| row | pure | compiled | compiled / pure (range) |",
        "|---|---:|---:|---|",
    ]
    for name, row in report["in_process"]["rows"].items():
        low, high = row["ratio_range"]
        lines.append(
            f"| {name} | {row['pure_us']} | {row['compiled_us']} | {row['compiled_over_pure']} ({low}-{high}) |"
        )
    lines += [
        "",
        "## End to end (front door on, `gorgo`, 3 mock nodes, `wrk -c32`; medians of rounds)",
        "",
        "| gateway | CPU µs / request | / pure (range) | requests per core | req/s at c32 | p50 ms at c1 |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for label, row in report["end_to_end"].items():
        low, high = row["cpu_over_pure_range"]
        lines.append(
            f"| {label} | {row['cpu_us_per_request']:.1f} | {row['cpu_over_pure']} ({low}-{high}) | "
            f"{row['requests_per_core_s']:.0f} | {row['requests_per_s_c32']:.0f} | {row['p50_ms_c1']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--iterations", type=int, default=20_000, help="calls per in-process row and round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, each variant in turn")
    parser.add_argument("--seconds", type=float, default=4.0, help="wrk duration per gateway and round")
    parser.add_argument(
        "--main", type=Path, default=None, help="a checkout of main (with its .venv) to compare"
    )
    parser.add_argument("--skip-e2e", action="store_true", help="only the in-process rows")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.child:
        child(args.iterations)
        return 0
    load_before = os.getloadavg()
    report: dict[str, Any] = {
        "generated_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "method": f"{args.rounds} rounds in turns, {args.iterations} calls per in-process row, "
        f"wrk {args.seconds:.0f} s per gateway and round",
        "in_process": in_process(args.rounds, args.iterations),
    }
    if not args.skip_e2e:
        report["end_to_end"] = end_to_end(args.rounds, args.seconds, args.main)
        if args.main is not None:
            report["main_commit"] = subprocess.run(
                ["git", "-C", str(args.main), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
            ).stdout.strip()
    report["commit"] = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    load_after = os.getloadavg()
    report["machine"] = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "load": f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after, {os.cpu_count()} vCPUs",
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "hotpath.json").write_text(json.dumps(report, indent=2) + "\n")
    markdown = _markdown(report) if "end_to_end" in report else json.dumps(report["in_process"], indent=2)
    (RESULTS / "hotpath.md").write_text(markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
