"""Routing quality: how much TTFT each routing policy costs on the emulated three-region fleet.

    python benchmarks/routing_quality.py            # full run, ~11 min; needs Redis at REDIS_URL
    python benchmarks/routing_quality.py --quick    # smoke run, ~1 min: 150 requests, 2 policies

For every (workload, policy) pair, on a fresh fleet so no run inherits another's cache or index:

- the fleet: the simulator's default topology (three regions, two nodes each, its RTTs), every
  node prefilling 10,638 tokens/s (the GORGO paper's 0.094 ms/token) with a KV cache of 2,048
  blocks (32k tokens, so caches evict) and ``max_model_len`` 16,384 (vLLM refuses a context longer
  than the cache), all six in one process (``python -m simulator --region-ports``);
- gorgo policies: one gateway per region as real processes (``python -m routing``) under a Redis
  prefix of the run's own. The policy goes to Redis as the control plane writes it (a
  ``PolicySnapshot`` with the contract's structs, no Django), and so does an ``RTTTable`` computed
  from the topology (the RTT plus the mean jitter, what the telemetry probes measure);
- the peer, the Rust ``vllm-router`` (``cache_aware``, its defaults), one per region, each
  pointed at the nodes' ports for its region (``SimNode.url_for``) so it pays the same WAN delay
  the gateways' ``X-Gorgo-Region`` header buys;
- the traffic: ``simulator.traffic`` plans, seeded, identical for every policy; clients in each
  region send to their region's gateway (or router). TTFT is measured by the client: request
  sent to first content token. The first 10 % of the arrivals warm the caches and are left out of
  the figures; then ``--requests`` (1,000) are measured. Bounded: arrivals stop at the count (or
  1.5x its expected duration) and answers still running 60 s later are cut and counted as errors.

Results: benchmarks/results/routing_quality.{json,md,png} (``--out`` to write elsewhere). The
numbers, the calibration of the rates and the targets are in the markdown.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import redis
from prometheus_client.parser import text_string_to_metric_families
from routing_quality_report import (  # this directory is on sys.path
    PEER,
    RunFigures,
    summarize_run,
    write_outputs,
)

from routing.contract import (
    ALGORITHMS,
    PARAMS_BY_ALGORITHM,
    SCHEMA_VERSION,
    ModelSpec,
    NodeSpec,
    PolicySnapshot,
    PolicySpec,
    RedisKeys,
    RegionSpec,
    RequestRecord,
    RTTEntry,
    RTTTable,
    decode,
    encode,
)
from routing.writer import write_snapshot
from simulator.harness import free_port, stop_process_group, wait_until
from simulator.topology import DEFAULT_TOPOLOGY_PATH, Topology, load_topology
from simulator.traffic import build_plan, run_plan
from simulator.traffic.runner import RequestResult
from simulator.traffic.workloads import WORKLOADS, Workload, WorkloadPlan

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
GORGO_POLICIES = ALGORITHMS
QUICK_POLICIES = ("least_load", "gorgo")

# The fleet (the same for every workload and policy).
PREFILL_TOKENS_PER_S = 1000.0 / 0.094  # the GORGO paper's 0.094 ms per prompt token
KV_CAPACITY_BLOCKS = 2048  # 32,768 tokens of 16-token blocks: small enough to evict
MAX_MODEL_LEN = 16_384  # must fit in the KV cache; the longest geo-chat prompt is ~10k tokens
ENGINE_OVERRIDES = {
    "prefill_tokens_per_s": PREFILL_TOKENS_PER_S,
    "kv_capacity_blocks": KV_CAPACITY_BLOCKS,
    "max_model_len": MAX_MODEL_LEN,
}
MAX_TOKENS = 128  # the traffic generator's default answer cap

# Arrival rates, calibrated once (``--calibrate``, method in the markdown): the rate at which the
# cache-oblivious least_load policy keeps the fleet's prefill 65 % busy, capped by what this
# 2-vCPU machine can drive without the harness itself becoming the bottleneck.
TARGET_PREFILL_UTILIZATION = 0.65
HARNESS_MAX_RATE_RPS = 80.0
RATE_RPS: dict[Workload, float] = {"geo-chat": 42.0, "no-share": 20.4, "hot-prefix": 80.0}
REQUESTS_PER_RUN = 1000  # measured, after the warm-up
# Sent first and left out of the figures: every run starts with empty caches and indexes, and in
# its first second every policy pays the same cold prefills; steady state is what is compared.
WARMUP_SHARE = 0.1
QUICK_REQUESTS_PER_RUN = 150
SEED = 1
DRAIN_S = 60.0


# ---- processes -------------------------------------------------------------------------------


@dataclass
class Proc:
    """A process this benchmark started (its own session, so stopping it stops its children)."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        stop_process_group(self.popen)


def spawn(name: str, argv: list[str], workdir: Path, env: dict[str, str] | None = None) -> Proc:
    log_path = workdir / f"{name}.log"
    with log_path.open("wb") as log_file:
        popen = subprocess.Popen(
            argv,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Proc(name, popen, log_path)


def wait_ready(proc: Proc, ready: Any, timeout_s: float = 30.0) -> Any:
    """``wait_until`` for one of this run's processes, with its log in the failure."""
    return wait_until(ready, timeout_s, what=f"{proc.name} ready", process=proc.popen, describe=proc.log)


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class FleetProc:
    """The six emulated nodes in one process, with their main and per-region URLs."""

    proc: Proc
    nodes: list[dict[str, Any]]  # {"name", "region", "url", "region_urls"}, topology order


def start_fleet(workdir: Path) -> FleetProc:
    argv = [sys.executable, "-m", "simulator", "--auto-ports", "--region-ports", "--json"]
    for name, value in ENGINE_OVERRIDES.items():
        argv += ["--engine", f"{name}={value}"]
    proc = spawn("fleet", argv, workdir)

    def described() -> dict[str, Any] | None:
        text = proc.log()
        if "simulator ready" not in text:
            return None
        return json.loads(next(line for line in text.splitlines() if line.startswith("{")))

    return FleetProc(proc, wait_ready(proc, described)["nodes"])


def start_gateways(
    workdir: Path, regions: list[str], redis_url: str, prefix: str
) -> tuple[list[Proc], dict[str, str]]:
    procs: list[Proc] = []
    for region in regions:
        env = {
            "GORGO_REGION": region,
            "GORGO_GATEWAY_ID": f"bench-{region}",
            "GORGO_GATEWAY_PORT": "0",
            "GORGO_REDIS_PREFIX": prefix,
            "REDIS_URL": redis_url,
            "LOG_LEVEL": "info",  # uvicorn prints the port it bound at info
            "GORGO_AUTH": "off",  # routing quality, not the front door (gateway_overhead.py measures it)
        }
        procs.append(spawn(f"gateway-{region}", [sys.executable, "-m", "routing"], workdir, env))
    urls: dict[str, str] = {}
    pattern = re.compile(r"Uvicorn running on (http://127\.0\.0\.1:\d+)")
    for region, proc in zip(regions, procs, strict=True):
        url = wait_ready(proc, lambda proc=proc: (m := pattern.search(proc.log())) and m.group(1))
        wait_ready(proc, lambda url=url: answers(f"{url}/healthz"))  # 200 once the policy is loaded
        urls[region] = url
    return procs, urls


def start_peers(
    workdir: Path, router: str, fleet: FleetProc, regions: list[str]
) -> tuple[list[Proc], dict[str, str]]:
    procs: list[Proc] = []
    urls: dict[str, str] = {}
    for region in regions:
        port = free_port()
        workers = [node["region_urls"][region] for node in fleet.nodes]
        argv = [router, "--worker-urls", *workers, "--policy", "cache_aware"]
        argv += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
        # Each instance also serves Prometheus metrics, on a fixed default port unless told.
        argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        proc = spawn(f"vllm-router-{region}", argv, workdir)
        procs.append(proc)
        urls[region] = f"http://127.0.0.1:{port}"
        wait_ready(proc, lambda port=port: answers(f"http://127.0.0.1:{port}/health"))
    return procs, urls


def find_peer() -> str | None:
    """The Rust router's launcher, if ``pip install vllm-router`` put it beside this Python."""
    beside = Path(sys.executable).parent / "vllm-router"
    return str(beside) if beside.exists() else shutil.which("vllm-router")


# ---- what the control plane and telemetry would write ------------------------------------------


def node_specs(topology: Topology, fleet: FleetProc) -> tuple[NodeSpec, ...]:
    specs = []
    for node_id, (spec, node) in enumerate(zip(topology.nodes, fleet.nodes, strict=True), start=1):
        assert spec.name == node["name"]
        specs.append(
            NodeSpec(
                id=node_id,
                name=spec.name,
                region=spec.region,
                base_url=node["url"],
                models=(spec.model,),
                gpu_type=spec.gpu_type,
                gpu_count=spec.gpu_count,
                max_num_seqs=spec.engine.max_num_seqs,
                prefill_tokens_per_s=PREFILL_TOKENS_PER_S,
                kv_capacity_tokens=KV_CAPACITY_BLOCKS * spec.engine.block_size,
                state="active",
            )
        )
    return tuple(specs)


def publish_policy(
    client: redis.Redis,
    keys: RedisKeys,
    topology: Topology,
    nodes: tuple[NodeSpec, ...],
    algorithm: str,
    overrides: dict[str, float] | None = None,
) -> None:
    """Write the RTT table and the policy snapshot, as telemetry and the control plane would.

    ``overrides`` set policy parameters the algorithm has (the others are ignored), for
    sensitivity runs; the committed results use every policy's defaults.
    """
    now_s = time.time()
    entries = tuple(
        RTTEntry(
            region=region.slug,
            node_id=node.id,
            # What a probe's EWMA converges to: the base RTT plus the mean of the additive jitter.
            rtt_ms=topology.rtt_ms(region.slug, node.region)
            + topology.jitter_ms(region.slug, node.region) / 2,
            jitter_ms=topology.jitter_ms(region.slug, node.region),
            samples=100,
            updated_at=now_s,
        )
        for region in topology.regions
        for node in nodes
    )
    client.set(keys.live_rtt, encode(RTTTable(SCHEMA_VERSION, now_s, entries)))
    model = topology.nodes[0].model
    snapshot = PolicySnapshot(
        schema_version=SCHEMA_VERSION,
        version=1,
        checksum=uuid.uuid4().hex,
        published_at=now_s,
        policy=PolicySpec(
            id=1,
            name=f"bench-{algorithm}",
            algorithm=algorithm,  # type: ignore[arg-type]
            params=_params(algorithm, overrides or {}),
        ),
        regions=tuple(RegionSpec(r.slug, r.name, r.latitude, r.longitude) for r in topology.regions),
        models=(ModelSpec(model, topology.nodes[0].engine.block_size, MAX_MODEL_LEN),),
        nodes=nodes,
    )
    if not write_snapshot(client, keys, snapshot):
        raise RuntimeError(f"{keys.prefix} already holds a newer policy snapshot")


def _params(algorithm: str, overrides: dict[str, float]) -> Any:
    params_type = PARAMS_BY_ALGORITHM[algorithm]
    known = {name: value for name, value in overrides.items() if name in params_type.__struct_fields__}
    return msgspec.convert(known, params_type)


def delete_namespace(client: redis.Redis, prefix: str) -> None:
    for key in client.scan_iter(match=f"{prefix}:*", count=500):
        client.delete(key)


# ---- one run ---------------------------------------------------------------------------------


@dataclass
class RunSpec:
    workload: Workload
    policy: str  # one of GORGO_POLICIES, or PEER
    rate_rps: float
    requests: int
    seed: int = SEED
    param_overrides: dict[str, float] = field(default_factory=dict)


@dataclass
class RunOutput:
    results: list[RequestResult]  # every request, warm-up included
    warmup_requests: int  # the first arrivals (by index), sent but left out of the figures
    node_counters: dict[str, dict[str, float]]  # node -> counter -> increase after the warm-up
    node_regions: dict[str, str]
    # Planned arrival times of the first measured and the last request: the work of the requests
    # that arrived in this window, over its length, is the load they offered the fleet.
    arrival_window_s: float
    records: list[RequestRecord] = field(default_factory=list)


COUNTERS = {
    "vllm:prefix_cache_queries_total": "queries",
    "vllm:prefix_cache_hits_total": "hits",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:num_preemptions_total": "preemptions",
}


async def scrape(http: httpx.AsyncClient, url: str) -> dict[str, float]:
    """The prefix-cache counters of one node, from its vLLM ``/metrics``."""
    values = dict.fromkeys(COUNTERS.values(), 0.0)
    text = (await http.get(f"{url}/metrics", timeout=10.0)).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = COUNTERS.get(sample.name)
            if name is not None:
                values[name] += sample.value
    return values


async def drive(
    plan: WorkloadPlan, targets: dict[str, str], node_urls: dict[str, str], warmup_requests: int
) -> tuple[list[RequestResult], dict[str, dict[str, float]]]:
    """Send the plan; snapshot the nodes' counters when the warm-up ends and after the last answer."""
    async with httpx.AsyncClient() as http:

        async def scrape_all() -> dict[str, dict[str, float]]:
            values = await asyncio.gather(*(scrape(http, url) for url in node_urls.values()))
            return dict(zip(node_urls, values, strict=True))

        loop = asyncio.get_running_loop()
        started_s = loop.time()
        warm_at_s = plan.arrivals[warmup_requests].at_s if warmup_requests < len(plan.arrivals) else 0.0

        async def at_warm_end() -> dict[str, dict[str, float]]:
            await asyncio.sleep(max(0.0, started_s + warm_at_s - loop.time()))
            return await scrape_all()

        warm = asyncio.create_task(at_warm_end())
        results = await run_plan(plan, targets, stream=True, request_timeout_s=120.0, drain_timeout_s=DRAIN_S)
        before = await warm
        after = await scrape_all()
    increase = {
        node: {name: after[node][name] - before[node][name] for name in after[node]} for node in after
    }
    return results, increase


def run_once(
    spec: RunSpec, topology: Topology, redis_url: str, workdir: Path, router: str | None
) -> RunOutput:
    regions = [region.slug for region in topology.regions]
    warmup = round(spec.requests * WARMUP_SHARE)
    plan = build_plan(
        spec.workload,
        regions,
        rate_rps=spec.rate_rps,
        # The count ends a run, not the clock: the duration leaves room for Poisson variation.
        duration_s=(spec.requests + warmup) / spec.rate_rps * 1.5,
        max_requests=spec.requests + warmup,
        seed=spec.seed,
        max_tokens=MAX_TOKENS,
    )
    fleet = start_fleet(workdir)
    procs: list[Proc] = [fleet.proc]
    client = redis.Redis.from_url(redis_url)
    prefix = f"gorgobench-rq-{uuid.uuid4().hex[:12]}"
    keys = RedisKeys(prefix=prefix)
    try:
        if spec.policy == PEER:
            assert router is not None
            peer_procs, targets = start_peers(workdir, router, fleet, regions)
            procs += peer_procs
        else:
            publish_policy(
                client, keys, topology, node_specs(topology, fleet), spec.policy, spec.param_overrides
            )
            gateway_procs, targets = start_gateways(workdir, regions, redis_url, prefix)
            procs += gateway_procs
        node_urls = {node["name"]: node["url"] for node in fleet.nodes}
        results, counters = asyncio.run(drive(plan, targets, node_urls, warmup))
        window_s = plan.arrivals[-1].at_s - plan.arrivals[min(warmup, len(plan.arrivals) - 1)].at_s
        records: list[RequestRecord] = []
        if spec.policy != PEER:
            time.sleep(0.3)  # the gateways flush their request logs every 50 ms
            records = [
                decode(fields[b"r"], RequestRecord) for _, fields in client.xrange(keys.request_stream)
            ]
        regions_of = {n["name"]: n["region"] for n in fleet.nodes}
        return RunOutput(results, warmup, counters, regions_of, window_s, records)
    finally:
        for proc in reversed(procs):
            proc.stop()
        delete_namespace(client, prefix)
        client.close()


# ---- calibration -----------------------------------------------------------------------------


def calibrate(
    workload: Workload, probe_rate_rps: float, requests: int, topology: Topology, redis_url: str
) -> dict[str, Any]:
    """Measure least_load's computed prefill per request and derive the rate for the target load."""
    workdir = Path(tempfile.mkdtemp(prefix="gorgo-rq-cal-"))
    output = run_once(
        RunSpec(workload, "least_load", probe_rate_rps, requests), topology, redis_url, workdir, None
    )
    figures = summarize_run(output, PREFILL_TOKENS_PER_S)
    computed_per_request = figures.computed_prefill_tokens / max(1, figures.requests)
    # Utilization grows about linearly with the rate while the hit rate holds; iterate if the
    # suggested rate is far from the probe (the hit rate falls as caches come under pressure).
    rate = probe_rate_rps * TARGET_PREFILL_UTILIZATION / max(figures.prefill_utilization, 1e-6)
    shutil.rmtree(workdir, ignore_errors=True)
    return {
        "workload": workload,
        "probe_rate_rps": probe_rate_rps,
        "requests": figures.requests,
        "computed_prefill_tokens_per_request": round(computed_per_request, 1),
        "prefill_utilization_at_probe": round(figures.prefill_utilization, 3),
        "rate_for_target_rps": round(rate, 2),
        "rate_used_rps": round(min(rate, HARNESS_MAX_RATE_RPS), 2),
    }


# ---- main ------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK_REQUESTS_PER_RUN} requests per run, policies {', '.join(QUICK_POLICIES)}",
    )
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset")
    parser.add_argument(
        "--policies", default=None, help=f"comma-separated subset of {', '.join((*GORGO_POLICIES, PEER))}"
    )
    parser.add_argument("--requests", type=int, default=None, help="requests per run")
    parser.add_argument("--seed", type=int, default=SEED, help="workload seed (the same for every policy)")
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set a policy parameter where the policy has it, e.g. chars_per_token=4.8 (sensitivity runs)",
    )
    parser.add_argument(
        "--rate", type=float, default=None, help="arrival rate for every workload (exploration)"
    )
    parser.add_argument("--no-peer", action="store_true", help=f"skip {PEER} even if installed")
    parser.add_argument(
        "--out",
        default=None,
        help="output path without extension (default: benchmarks/results/routing_quality; var/routing_quality_quick with --quick)",
    )
    parser.add_argument(
        "--raw", default=None, help="also write every request's result to DIR/<workload>-<policy>.jsonl"
    )
    parser.add_argument(
        "--calibrate", action="store_true", help="measure the rates instead (least_load at --probe-rate)"
    )
    parser.add_argument("--probe-rate", type=float, default=10.0, help="arrival rate of a --calibrate run")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM as SystemExit, so the finally blocks stop the fleet, gateways and routers it started.
    signal.signal(signal.SIGTERM, lambda _signum, _frame: sys.exit(143))
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    redis.Redis.from_url(redis_url).ping()  # fail early with a clear error
    topology = load_topology(DEFAULT_TOPOLOGY_PATH)
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown:
        raise SystemExit(f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}")
    if args.calibrate:
        for workload in workloads:
            print(
                json.dumps(calibrate(workload, args.probe_rate, args.requests or 600, topology, redis_url)),
                flush=True,
            )  # type: ignore[arg-type]
        return 0

    requests = args.requests or (QUICK_REQUESTS_PER_RUN if args.quick else REQUESTS_PER_RUN)
    router = None if args.no_peer else find_peer()
    if args.policies:
        policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    else:
        policies = list(QUICK_POLICIES if args.quick else (*GORGO_POLICIES, PEER))
    unknown = sorted(set(policies) - {*GORGO_POLICIES, PEER})
    if unknown:
        raise SystemExit(f"unknown policy(ies) {unknown}")
    notes: list[str] = []
    param_overrides = {name: float(value) for name, _, value in (item.partition("=") for item in args.param)}
    if param_overrides:
        notes.append(f"policy parameters overridden: {param_overrides}")
    if PEER in policies and router is None:
        policies.remove(PEER)
        notes.append(
            f"{PEER} skipped: not installed (`pip install vllm-router`)"
            if not args.no_peer
            else f"{PEER} skipped (--no-peer)"
        )
    out = (
        Path(args.out)
        if args.out
        else (ROOT / "var" / "routing_quality_quick" if args.quick else RESULTS / "routing_quality")
    )
    out.parent.mkdir(parents=True, exist_ok=True)

    workdir = Path(tempfile.mkdtemp(prefix="gorgo-rq-"))
    started_s = time.perf_counter()
    runs: dict[str, dict[str, RunFigures]] = {}
    failed = False
    for workload in workloads:
        rate = args.rate or RATE_RPS[workload]  # type: ignore[index]
        for policy in policies:
            print(f"{workload:>10} {policy:<16} {requests} requests at {rate:g}/s ...", end=" ", flush=True)
            run_started_s = time.perf_counter()
            try:
                output = run_once(
                    RunSpec(workload, policy, rate, requests, args.seed, param_overrides),
                    topology,
                    redis_url,
                    workdir,
                    router,
                )  # type: ignore[arg-type]
            except Exception as exc:  # a run that cannot start is reported; the others go on
                failed = True
                print(f"FAILED: {exc}", flush=True)
                notes.append(f"{workload}/{policy} failed: {str(exc)[:300]}")
                continue
            figures = summarize_run(output, PREFILL_TOKENS_PER_S)
            runs.setdefault(workload, {})[policy] = figures
            if args.raw:
                raw_dir = Path(args.raw)
                raw_dir.mkdir(parents=True, exist_ok=True)
                with (raw_dir / f"{workload}-{policy}.jsonl").open("wb") as raw:
                    raw.writelines(msgspec.json.encode(result) + b"\n" for result in output.results)
            print(
                f"p50 {figures.ttft_p50_ms:.0f} p90 {figures.ttft_p90_ms:.0f} p99 {figures.ttft_p99_ms:.0f} ms,"
                f" hit {figures.prefix_hit_rate:.0%}, cross {figures.cross_region_share:.0%},"
                f" errors {figures.errors}, util {figures.prefill_utilization:.0%},"
                f" send lag p99 {figures.send_lag_p99_ms:.0f} ms"
                f" ({time.perf_counter() - run_started_s:.0f}s)",
                flush=True,
            )
    meta = {
        "command": "python benchmarks/routing_quality.py" + (" --quick" if args.quick else ""),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": f"{platform.platform()}, Python {platform.python_version()}, {os.cpu_count()} CPUs",
        "duration_s": round(time.perf_counter() - started_s, 1),
        "requests_per_run": requests,
        "seed": args.seed,
        "max_tokens": MAX_TOKENS,
        "rates_rps": {w: args.rate or RATE_RPS[w] for w in workloads},  # type: ignore[index]
        "target_prefill_utilization": TARGET_PREFILL_UTILIZATION,
        "harness_max_rate_rps": HARNESS_MAX_RATE_RPS,
        "fleet": {
            "topology": str(DEFAULT_TOPOLOGY_PATH.relative_to(ROOT)),
            "nodes": len(topology.nodes),
            **{key: value for key, value in ENGINE_OVERRIDES.items()},
            "kv_capacity_tokens": KV_CAPACITY_BLOCKS * topology.nodes[0].engine.block_size,
            "rtt_ms": {
                f"{a.slug}<->{b.slug}": topology.rtt_ms(a.slug, b.slug)
                for i, a in enumerate(topology.regions)
                for b in topology.regions[i:]
            },
        },
        "rtt_source": "RTTTable published to live_rtt from the topology (RTT + mean jitter)",
        "peer": {"name": PEER, "policy": "cache_aware", "path": router} if router else None,
        "notes": notes,
        "quick": args.quick,
    }
    paths = write_outputs(out, meta, runs)
    print(f"wrote {', '.join(str(p) for p in paths)} in {meta['duration_s']:.0f}s", flush=True)
    if failed:
        print(f"process logs kept in {workdir}", flush=True)
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
