"""Routing quality: how much TTFT each routing policy costs on an emulated geo-distributed fleet.

    python benchmarks/routing_quality.py                      # the committed run (README: its time)
    python benchmarks/routing_quality.py --quick              # smoke run, ~1 min
    python benchmarks/routing_quality.py --workloads four-region --topology my.toml \
        --client-share ap-south=0.4,us-east=0.3,eu-central=0.3 --seeds 1 --out var/my-run

Each scenario (a workload on a topology with a client mix, ``SCENARIOS``) runs every policy per
seed, each run on the fleet as a new process starts it, so no run inherits another's cache or index
(one fleet process per topology, reset between runs: ``Fleets``); without ``--out`` each workload's
report goes to benchmarks/results/routing_quality/<workload>.{json,md,png} as soon as it is done:

- the fleet: the scenario's topology file (``--topology`` replaces it), every node prefilling
  10,638 tokens/s (the GORGO paper's 0.094 ms/token) with a KV cache of 2,048 blocks (32k tokens,
  so caches evict) and ``max_model_len`` 16,384, all nodes in one process (``python -m simulator
  --topology ... --region-ports --control-port ... --oracle``);
- gorgo policies: one gateway per region as real processes (``python -m routing``) under a Redis
  prefix of the run's own, the policy written as the control plane writes it (a ``PolicySnapshot``)
  with an ``RTTTable`` computed from the topology (RTT plus the mean jitter);
- the regional baseline (what operators deploy today: geo-DNS to the nearest region and a
  cache-aware router per region over that region's nodes only): ``vllm-router@local`` (the Rust
  ``vllm-router``, ``cache_aware``, one per region over its region's nodes) and
  ``prefix_affinity@local`` (gorgo's gateways with ``prefix_affinity``, ``scope: local``);
- the global peer ``vllm-router`` (one per region over every node, through the nodes' ports for
  its region so it pays the same WAN delay);
- the traffic: ``simulator.traffic`` plans, seeded, identical for every policy; clients in each
  region send to their region's gateway (or router). TTFT is measured by the client. The first 10 %
  of the arrivals warm the caches and are left out of the figures. ``region-outage`` stops the
  first region's nodes through the simulator's fault API and restarts them; the outage is noticed
  ``DETECTION_S`` later (gateways: the nodes' live state turns unhealthy, as telemetry's health
  check writes it; the regional vllm-router: its region's clients are repointed to the nearest
  other region's router, as geo-DNS failover does, through a delay proxy at the RTT between the
  two regions, so they pay the WAN that gorgo's gateways pay when they forward abroad);
- the oracle: the simulator logs, as each request reaches the fleet, the fastest first token any
  node could give it (RTT from the client's region, the blocks that node holds, its prefill speed,
  no queue); each policy's TTFT is reported against it, and each request's TTFT is split (from the
  fleet's log of what it spent at the node that served it) into RTT, intake, queue, prefill, the
  emulator's lag and the rest (gateway, hops, jitter), as is its gap to the bound
  (``routing_quality_report.attribute``).

Each run's wall clock is split into phases (``Phases``: the fleet's reset, the routers' start,
the arrivals, the wait for the last first token, teardown; ``phases_s`` in the JSON). A run stops
reading answers once every request has its first token (nothing measured depends on the rest).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gorgo_lb_peer  # this directory is on sys.path
import httpx
import msgspec
import redis
from prometheus_client.parser import text_string_to_metric_families
from routing_quality_report import (  # this directory is on sys.path
    PEER,
    PEER_LOCAL,
    RunFigures,
    Served,
    summarize_run,
    write_outputs,
)
from wan_state import (
    SHARED_STATES,
    WAN_SUFFIX,
    WanRedis,
    home_region,
    publish_bench_key,
    start_wan_redis,
    state_rtts_ms,
    summary_markdown,
    wan_summary,
)

from routing.contract import (
    ALGORITHMS,
    PARAMS_BY_ALGORITHM,
    SCHEMA_VERSION,
    ModelSpec,
    NodeLiveState,
    NodeSpec,
    RedisKeys,
    RegionSpec,
    RequestRecord,
    RTTEntry,
    RTTTable,
    decode,
    encode,
)
from routing.writer import write
from simulator.harness import exit_on_sigterm, free_port, stop_process_group, stop_process_groups, wait_until
from simulator.server import oracle_key_of
from simulator.snapshots import make_node, make_snapshot
from simulator.topology import DEFAULT_TOPOLOGY_PATH, EngineParams, Topology, load_topology
from simulator.topology import NodeSpec as TopologyNode
from simulator.traffic import build_plan, run_plan
from simulator.traffic.runner import RequestResult
from simulator.traffic.workloads import (
    DIURNAL_PEAK_SHARE,
    Workload,
    WorkloadPlan,
    check_client_shares,
)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
# The committed run's reports, one per workload (``python benchmarks/routing_quality.py``).
RESULTS_DIR = RESULTS / "routing_quality"
FOUR_REGION_TOPOLOGY_PATH = ROOT / "simulator" / "topologies" / "four-region-short.toml"

# Policies run by the gateways: report name -> (algorithm, parameters other than the defaults).
# Every algorithm of the contract under its own name, plus the variants the issue compares.
GORGO_POLICIES: dict[str, tuple[str, dict[str, Any]]] = {
    **{name: (name, {}) for name in ALGORITHMS},
    "prefix_affinity@local": ("prefix_affinity", {"scope": "local"}),
    "gorgo@greedy": ("gorgo", {"w_displacement": 0.0}),
}
PEERS = (PEER, PEER_LOCAL)
# The GORGO paper's own router (PyPI gorgo-lb) behind an adapter: benchmarks/gorgo_lb_peer.py.
GORGO_LB = tuple(gorgo_lb_peer.VARIANTS)
DEFAULT_POLICIES = (
    "least_load",
    "prefix_affinity",
    PEER,
    PEER_LOCAL,
    "prefix_affinity@local",
    "gorgo-lb",
    "gorgo-lb@central",
    "gorgo-lb+es",
    "gorgo@greedy",
    "gorgo",
)
QUICK_POLICIES = ("prefix_affinity@local", "gorgo")
# gorgo@greedy only where overflow happens (the design comparison); the others everywhere.
OVERFLOW_ONLY_POLICIES = ("gorgo@greedy",)

# The fleet (the same for every workload and policy).
PREFILL_TOKENS_PER_S = 1000.0 / 0.094  # the GORGO paper's 0.094 ms per prompt token
KV_CAPACITY_BLOCKS = 2048  # 32,768 tokens of 16-token blocks: small enough to evict
MAX_MODEL_LEN = 16_384  # must fit in the KV cache; the longest geo-chat prompt is ~10k tokens
# The fleet's engine (the topology's [engine] table replaced by these; a node's own [nodes.engine]
# entries still win, so a topology of mixed GPUs stays mixed: ``node_engine``).
ENGINE_OVERRIDES = {
    "prefill_tokens_per_s": PREFILL_TOKENS_PER_S,
    "kv_capacity_blocks": KV_CAPACITY_BLOCKS,
    "max_model_len": MAX_MODEL_LEN,
}


def node_engine(spec: TopologyNode) -> EngineParams:
    """How a node of the topology performs in this benchmark (``ENGINE_OVERRIDES`` under its own)."""
    return spec.engine_under(ENGINE_OVERRIDES)


def fleet_prefill_tokens_per_s(topology: Topology) -> float:
    """The fleet's mean prefill speed per node (the paper's figure unless the topology mixes GPUs)."""
    return sum(node_engine(n).prefill_tokens_per_s for n in topology.nodes) / len(topology.nodes)


MAX_TOKENS = 128  # the traffic generator's default answer cap

# Arrival rates, calibrated once on the three-region fleet (``--calibrate``, method in the
# markdown): the rate at which the cache-oblivious least_load policy keeps the fleet's prefill 65 %
# busy (geo-chat 42/s, no-share 20.4/s over six nodes), capped by what this 2-vCPU machine can
# drive. Per node, so another topology gets the same load per node.
TARGET_PREFILL_UTILIZATION = 0.65
HARNESS_MAX_RATE_RPS = 80.0
RATE_RPS_PER_NODE: dict[Workload, float] = {
    "geo-chat": 7.0,
    "region-outage": 7.0,
    "no-share": 3.4,
    # Long answers hold the batch and the KV cache for seconds: at 1.5/s a node has ~10 sequences
    # of ~2.4k tokens in flight (70 % of its KV cache) and its prefill ~25 % busy, so queues come
    # from length mix and imbalance, not from overload.
    "mixed-length": 1.5,
}
FIXED_RATE_RPS: dict[Workload, float] = {"hot-prefix": 80.0}
# diurnal: the peak region receives DIURNAL_PEAK_SHARE of the requests at this multiple of what
# an average region's nodes can prefill (unique prompts of 1k-3k tokens, 2k on average).
DIURNAL_PEAK_LOAD = 2.0
DIURNAL_MEAN_PROMPT_TOKENS = 2000
REQUESTS_PER_RUN = 320  # measured, after the warm-up (a flag: --requests)
# Sent first and left out of the figures: every run starts with empty caches and indexes, and in
# its first second every policy pays the same cold prefills; steady state is what is compared.
WARMUP_SHARE = 0.1
QUICK_REQUESTS_PER_RUN = 150
SEEDS = (1, 2, 3)
DRAIN_S = 60.0
# How every run handles its processes and traffic (the JSON's meta.harness): one emulated fleet
# per topology, reset between runs instead of restarted; answers no longer read once every request
# has its first token; routers started together and stopped together.
HARNESS = {
    "fleet": "one process per topology, POST /reset before each run (Fleet.reset)",
    "answers_read": "until every request has its first token (cut_after_first_token)",
}
# How long after a node dies (or returns) the routers act on it: telemetry's health check marks
# it in the live state; geo-DNS repoints the region's clients. Both generous to every policy.
DETECTION_S = 1.0


@dataclass(frozen=True)
class Scenario:
    """A workload on a topology with a client mix: one section of the report."""

    name: str
    workload: Workload
    topology_path: Path
    client_shares: dict[str, float] | None = None  # region -> share; None: even


SCENARIOS: dict[str, Scenario] = {
    "geo-chat": Scenario("geo-chat", "geo-chat", DEFAULT_TOPOLOGY_PATH),
    "diurnal": Scenario("diurnal", "diurnal", DEFAULT_TOPOLOGY_PATH),
    "region-outage": Scenario("region-outage", "region-outage", DEFAULT_TOPOLOGY_PATH),
    # The under-provisioned case: ap-northeast has one node and 40 % of the clients.
    "four-region": Scenario(
        "four-region",
        "geo-chat",
        FOUR_REGION_TOPOLOGY_PATH,
        {"ap-northeast": 0.4, "us-west": 0.2, "eu-west": 0.2, "sa-east": 0.2},
    ),
    "mixed-length": Scenario("mixed-length", "mixed-length", DEFAULT_TOPOLOGY_PATH),
    "no-share": Scenario("no-share", "no-share", DEFAULT_TOPOLOGY_PATH),
    "hot-prefix": Scenario("hot-prefix", "hot-prefix", DEFAULT_TOPOLOGY_PATH),
}
DEFAULT_SCENARIOS = ("geo-chat", "diurnal", "region-outage", "four-region", "mixed-length")
OVERFLOW_SCENARIOS = ("diurnal", "four-region")


def scenario_rate(scenario: Scenario, topology: Topology) -> float:
    """The arrival rate of a scenario on a topology (see the constants above)."""
    workload = scenario.workload
    if workload in FIXED_RATE_RPS:
        return FIXED_RATE_RPS[workload]
    # Per node at the paper's speed: a fleet of faster or slower GPUs gets the same load per node.
    paper_nodes = fleet_prefill_tokens_per_s(topology) * len(topology.nodes) / PREFILL_TOKENS_PER_S
    if workload == "diurnal":
        region_tokens_per_s = PREFILL_TOKENS_PER_S * paper_nodes / len(topology.regions)
        rate = DIURNAL_PEAK_LOAD * region_tokens_per_s / DIURNAL_MEAN_PROMPT_TOKENS / DIURNAL_PEAK_SHARE
    else:
        rate = RATE_RPS_PER_NODE[workload] * paper_nodes
    return round(min(rate, HARNESS_MAX_RATE_RPS), 1)


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
    control_url: str  # the fault API (and GET /oracle)


def start_fleet(workdir: Path, topology_path: Path, name: str = "fleet") -> FleetProc:
    control_port = free_port()
    argv = [sys.executable, "-m", "simulator", "--topology", str(topology_path), "--auto-ports"]
    argv += ["--region-ports", "--json", "--oracle", "--control-port", str(control_port)]
    for name, value in ENGINE_OVERRIDES.items():
        argv += ["--engine-default", f"{name}={value}"]
    proc = spawn(name, argv, workdir)

    def described() -> dict[str, Any] | None:
        text = proc.log()
        if "simulator ready" not in text:
            return None
        return json.loads(next(line for line in text.splitlines() if line.startswith("{")))

    return FleetProc(proc, wait_ready(proc, described)["nodes"], f"http://127.0.0.1:{control_port}")


@dataclass
class Fleets:
    """The emulated fleet of a benchmark, one process kept across runs: before each run it is reset
    (``POST /reset``: every node restarted with an empty KV cache, nothing in flight, zeroed
    counters, its jitter from the seed again, the oracle's log emptied; tests/simulator/
    test_control_api.py) instead of started anew, which took ~1 s of start and ~0.5 s of stop per
    run. One topology at a time: another topology's run stops it and starts its own."""

    workdir: Path
    current: tuple[Path, FleetProc] | None = None

    def ready(self, topology_path: Path) -> FleetProc:
        """The fleet of ``topology_path``, as a new process would start it."""
        if self.current is not None:
            path, fleet = self.current
            if path == topology_path and fleet.proc.popen.poll() is None:
                try:
                    reset = httpx.post(f"{fleet.control_url}/reset", timeout=30.0)
                    reset.raise_for_status()
                    if all(node["up"] for node in reset.json()["nodes"]):
                        return fleet
                except httpx.HTTPError:
                    pass  # start a new one below
            self.stop()
        fleet = start_fleet(self.workdir, topology_path, name=f"fleet-{topology_path.stem}")
        self.current = (topology_path, fleet)
        return fleet

    def stop(self) -> None:
        if self.current is not None:
            self.current[1].proc.stop()
            self.current = None


def start_gateways(
    workdir: Path,
    regions: list[str],
    redis_url: str,
    prefix: str,
    command: tuple[str, ...] = ("-m", "routing"),
    *,
    front_door: bool = False,
    region_env: dict[str, dict[str, str]] | None = None,
) -> tuple[list[Proc], dict[str, str]]:
    """One gateway per region (``command``: the Python arguments that run one).

    ``region_env``: a region's own settings (``REDIS_URL`` through that region's WAN delay)."""
    procs: list[Proc] = []
    for region in regions:
        env = {
            "GORGO_REGION": region,
            "GORGO_GATEWAY_ID": f"bench-{region}",
            "GORGO_GATEWAY_PORT": "0",
            "GORGO_REDIS_PREFIX": prefix,
            "REDIS_URL": redis_url,
            "LOG_LEVEL": "info",  # the gateway logs the port it bound at info
            # Routing quality, not the front door (gateway_overhead.py measures its cost), unless
            # a run asks for it (--front-door: what shared limits add over the WAN).
            "GORGO_AUTH": "on" if front_door else "off",
            **(region_env or {}).get(region, {}),
        }
        procs.append(spawn(f"gateway-{region}", [sys.executable, *command], workdir, env))
    urls: dict[str, str] = {}
    pattern = re.compile(r"listening on (http://127\.0\.0\.1:\d+)")
    for region, proc in zip(regions, procs, strict=True):
        url = wait_ready(proc, lambda proc=proc: (m := pattern.search(proc.log())) and m.group(1))
        wait_ready(proc, lambda url=url: answers(f"{url}/healthz"))  # 200 once the policy is loaded
        urls[region] = url
    return procs, urls


def start_peers(
    workdir: Path, router: str, fleet: FleetProc, regions: list[str], *, local: bool
) -> tuple[list[Proc], dict[str, str]]:
    """One router per region: over every node (``local=False``) or its region's nodes only."""
    procs: list[Proc] = []
    urls: dict[str, str] = {}
    for region in regions:
        port = free_port()
        workers = [
            node["region_urls"][region] for node in fleet.nodes if not local or node["region"] == region
        ] or [node["region_urls"][region] for node in fleet.nodes]  # a region without nodes: all
        argv = [router, "--worker-urls", *workers, "--policy", "cache_aware"]
        argv += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
        # Each instance also serves Prometheus metrics, on a fixed default port unless told.
        argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        procs.append(spawn(f"vllm-router-{region}", argv, workdir))
        urls[region] = f"http://127.0.0.1:{port}"
    for proc, url in zip(procs, urls.values(), strict=True):  # started together, waited for after
        wait_ready(proc, lambda url=url: answers(f"{url}/health"))
    return procs, urls


def start_failover_delays(
    workdir: Path, topology: Topology, targets: dict[str, str], regions: list[str]
) -> tuple[list[Proc], dict[str, str]]:
    """Geo-DNS failover as the clients feel it: for each of ``regions``, a delay proxy (one
    ``python -m simulator.tcp_delay``) in front of the nearest other region's router, at the RTT
    between the two. The regional routers reach their own nodes at in-region RTT, so a region's
    clients repointed straight at the other region's router would pay no WAN at all (the run of
    2026-11-26 showed us-east's clients 80 % abroad at a 62 ms p50 beside an 88 ms RTT)."""
    procs: list[Proc] = []
    urls: dict[str, str] = {}
    for region in regions:
        nearest = nearest_region(topology, region)
        upstream = targets[nearest].removeprefix("http://")
        argv = [sys.executable, "-m", "simulator.tcp_delay", "--upstream", upstream]
        # the mean of what the nodes' per-region ports add (each way: RTT/2 + U(0, jitter/2))
        rtt_ms = topology.rtt_ms(region, nearest) + topology.jitter_ms(region, nearest) / 2.0
        argv += ["--rtt-ms", f"{rtt_ms:g}"]
        proc = spawn(f"failover-{region}", argv, workdir)
        procs.append(proc)

        def port(proc: Proc = proc) -> int | None:
            for line in proc.log().splitlines():
                if line.startswith("{"):
                    return int(json.loads(line)["ports"][0])
            return None

        urls[region] = f"http://127.0.0.1:{wait_ready(proc, port)}"
    return procs, urls


def find_peer() -> str | None:
    """The Rust router's launcher, if ``pip install vllm-router`` put it beside this Python."""
    beside = Path(sys.executable).parent / "vllm-router"
    return str(beside) if beside.exists() else shutil.which("vllm-router")


# ---- what the control plane and telemetry would write ------------------------------------------


def node_specs(topology: Topology, fleet: FleetProc, told_prefill_scale: float = 1.0) -> tuple[NodeSpec, ...]:
    """The nodes as the policy describes them: each node's own prefill speed and KV cache (as its
    operator would register them), the speed times ``told_prefill_scale`` (wrong inputs)."""
    specs = []
    for node_id, (spec, node) in enumerate(zip(topology.nodes, fleet.nodes, strict=True), start=1):
        assert spec.name == node["name"]
        engine = node_engine(spec)
        specs.append(
            make_node(
                node_id,
                node["url"],
                name=spec.name,
                region=spec.region,
                models=(spec.model,),
                gpu_type=spec.gpu_type,
                gpu_count=spec.gpu_count,
                max_num_seqs=engine.max_num_seqs,
                prefill_tokens_per_s=engine.prefill_tokens_per_s * told_prefill_scale,
                kv_capacity_tokens=engine.kv_capacity_tokens,
            )
        )
    return tuple(specs)


def publish_policy(
    client: redis.Redis,
    keys: RedisKeys,
    topology: Topology,
    nodes: tuple[NodeSpec, ...],
    algorithm: str,
    overrides: dict[str, Any] | None = None,
    rtt_scale: float = 1.0,
) -> None:
    """Write the RTT table and the policy snapshot, as telemetry and the control plane would.

    ``overrides`` set policy parameters the algorithm has (the others are ignored): the policy's
    own (``GORGO_POLICIES``) and a run's ``--param``s.
    """
    publish_rtt(client, keys, topology, nodes, rtt_scale)
    model = topology.nodes[0].model
    snapshot = make_snapshot(
        nodes,
        params=_params(algorithm, overrides or {}),
        regions=tuple(RegionSpec(r.slug, r.name, r.latitude, r.longitude) for r in topology.regions),
        models=(ModelSpec(model, topology.nodes[0].engine.block_size, MAX_MODEL_LEN),),
        name=f"bench-{algorithm}",
        checksum=uuid.uuid4().hex,
    )
    if not write(client, keys, snapshot):
        raise RuntimeError(f"{keys.prefix} already holds a newer policy snapshot")


def publish_rtt(
    client: redis.Redis,
    keys: RedisKeys,
    topology: Topology,
    nodes: tuple[NodeSpec, ...],
    rtt_scale: float = 1.0,
) -> None:
    """The RTT table telemetry's probes would write (``rtt_scale``: a table that far off)."""
    now_s = time.time()
    entries = tuple(
        RTTEntry(
            region=region.slug,
            node_id=node.id,
            # What a probe's EWMA converges to: the base RTT plus the mean of the additive jitter.
            rtt_ms=(
                topology.rtt_ms(region.slug, node.region) + topology.jitter_ms(region.slug, node.region) / 2
            )
            * rtt_scale,
            jitter_ms=topology.jitter_ms(region.slug, node.region),
            samples=100,
            updated_at=now_s,
        )
        for region in topology.regions
        for node in nodes
    )
    client.set(keys.live_rtt, encode(RTTTable(SCHEMA_VERSION, now_s, entries)))


def _params(algorithm: str, overrides: dict[str, Any]) -> Any:
    params_type = PARAMS_BY_ALGORITHM[algorithm]
    known = {name: value for name, value in overrides.items() if name in params_type.__struct_fields__}
    return msgspec.convert(known, params_type)


def delete_namespace(client: redis.Redis, prefix: str) -> None:
    for key in client.scan_iter(match=f"{prefix}:*", count=500):
        client.delete(key)


# ---- one run ---------------------------------------------------------------------------------


@dataclass
class RunSpec:
    scenario: Scenario
    policy: str  # a key of GORGO_POLICIES, or one of PEERS
    rate_rps: float
    requests: int
    seed: int = 1
    param_overrides: dict[str, float | bool] = field(default_factory=dict)
    shared_state: str = "loopback"  # or "wan": the gateways reach Redis through their region's delay
    front_door: bool = False  # a client key with limits on every gateway request
    # Wrong inputs (benchmarks/routing_sensitivity.py): the policy is told prefill speeds this many
    # times the nodes' real one, and an RTT table this many times the real round trips.
    told_prefill_scale: float = 1.0
    told_rtt_scale: float = 1.0
    # Arrivals sent before the measured ones (None: WARMUP_SHARE of ``requests``): a longer warm-up
    # measures a steady state (routing_sensitivity.py: after the gateways measured their inputs).
    warmup_requests: int | None = None


def warmup_count(requests: int, warmup_requests: int | None) -> int:
    """How many arrivals warm the fleet up before ``requests`` measured ones (None: the default share)."""
    return warmup_requests if warmup_requests is not None else round(requests * WARMUP_SHARE)


def warmup_of(spec: RunSpec) -> int:
    """How many arrivals warm the fleet up before the measured ones."""
    return warmup_count(spec.requests, spec.warmup_requests)


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
    oracle_ms: dict[int, float] = field(default_factory=dict)  # request index -> lower bound
    peer_state: dict[str, Any] | None = None  # gorgo-lb: each adapter's final weights and tuner
    served: dict[int, Served] = field(default_factory=dict)  # request index -> its time at the node
    phases_s: dict[str, float] = field(default_factory=dict)  # where the run's wall clock went


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


@dataclass
class OutageActions:
    """What a run does when a region's nodes die and come back (region-outage)."""

    control_url: str
    nodes_of: dict[str, list[str]]  # region -> node names
    # after DETECTION_S: (region, healthy) -> None, the routers' reaction (live state or DNS)
    on_detected: Any


async def apply_outages(plan: WorkloadPlan, actions: OutageActions, http: httpx.AsyncClient) -> None:
    """Stop and restart the outage regions' nodes on the plan's clock (simulator fault API)."""
    loop = asyncio.get_running_loop()
    started_s = loop.time()
    events = sorted(
        [(o.start_s, o.region, "stop") for o in plan.outages]
        + [(o.end_s, o.region, "start") for o in plan.outages]
    )
    for at_s, region, action in events:
        await asyncio.sleep(max(0.0, started_s + at_s - loop.time()))
        for name in actions.nodes_of[region]:
            (await http.post(f"{actions.control_url}/nodes/{name}/{action}", timeout=10.0)).raise_for_status()
        await asyncio.sleep(DETECTION_S)
        actions.on_detected(region, action == "start")


async def drive(
    plan: WorkloadPlan,
    targets: dict[str, str],
    node_urls: dict[str, str],
    warmup_requests: int,
    outages: OutageActions | None = None,
    api_key: str | None = None,
) -> tuple[list[RequestResult], dict[str, dict[str, float]], dict[str, Any]]:
    """Send the plan; snapshot the nodes' counters when the warm-up ends and after the last answer.

    Also returns the fleet's oracle log (``GET /oracle``: the bounds and what each request spent)."""
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
        faults = asyncio.create_task(apply_outages(plan, outages, http)) if outages and plan.outages else None
        # Stop reading answers once every request has its first token: no figure depends on the
        # rest (mixed-length's 256-1,024-token answers ran ~7 s past the last first token).
        results = await run_plan(
            plan,
            targets,
            stream=True,
            request_timeout_s=120.0,
            drain_timeout_s=DRAIN_S,
            api_key=api_key,
            until_first_tokens=True,
        )
        before = await warm
        if faults is not None:
            await faults
        after = await scrape_all()
        oracle = (await http.get(f"{outages.control_url}/oracle", timeout=30.0)).json() if outages else {}
    increase = {
        node: {name: after[node][name] - before[node][name] for name in after[node]} for node in after
    }
    return results, increase, oracle


def _logged_keys(plan: WorkloadPlan) -> dict[int, str]:
    """Each arrival's key in the simulator's oracle log (``simulator.server.oracle_key``)."""
    first_text: dict[str, str] = {}
    for arrival in plan.arrivals:
        if arrival.turn == 0:
            first_text[arrival.conversation_id] = arrival.user_text
    return {
        arrival.index: oracle_key_of(first_text.get(arrival.conversation_id, ""), arrival.turn + 1)
        for arrival in plan.arrivals
    }


def oracle_by_index(plan: WorkloadPlan, oracle: dict[str, Any]) -> dict[int, float]:
    """Each arrival's lower bound, found by the key the simulator logged it under."""
    bounds = oracle.get("requests", {})
    found: dict[int, float] = {}
    for index, key in _logged_keys(plan).items():
        entry = bounds.get(key)
        if entry is not None:
            found[index] = float(entry[1])
    return found


def served_by_index(plan: WorkloadPlan, oracle: dict[str, Any], topology: Topology) -> dict[int, Served]:
    """Each arrival's time at the node that served it, beside its bound's (``Served``)."""
    bounds = oracle.get("requests", {})
    served = oracle.get("served", {})
    regions = {node.name: node.region for node in topology.nodes}
    found: dict[int, Served] = {}
    for index, key in _logged_keys(plan).items():
        bound, at = bounds.get(key), served.get(key)
        if bound is None or at is None or at[0] not in regions:
            continue
        client_region, _, bound_rtt_ms, bound_compute_ms = bound
        node, intake_ms, queued_ms, prefill_ms, late_ms = at
        found[index] = Served(
            rtt_ms=topology.rtt_ms(client_region, regions[node]),
            intake_ms=float(intake_ms),
            queue_ms=float(queued_ms),
            prefill_ms=float(prefill_ms),
            lag_ms=float(late_ms),
            bound_rtt_ms=float(bound_rtt_ms),
            bound_compute_ms=float(bound_compute_ms),
        )
    return found


def mark_health(client: redis.Redis, keys: RedisKeys, node_ids: list[int], healthy: bool) -> None:
    """What telemetry's health check writes when nodes stop (or start) answering."""
    now_s = time.time()
    with client.pipeline() as pipe:
        for node_id in node_ids:
            state = NodeLiveState(SCHEMA_VERSION, node_id, healthy=healthy, updated_at=now_s)
            pipe.hset(keys.live_nodes, str(node_id), encode(state))
        pipe.publish(keys.live_channel, keys.live_nodes)
        pipe.execute()


def nearest_region(topology: Topology, region: str) -> str:
    others = [r.slug for r in topology.regions if r.slug != region]
    return min(others, key=lambda other: topology.rtt_ms(region, other))


class Phases:
    """Where a run's wall clock goes: seconds per named phase (``lap``: since the previous lap)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last_s = time.perf_counter()

    def lap(self, name: str) -> None:
        now_s = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now_s - self._last_s
        self._last_s = now_s


def drive_phases(plan: WorkloadPlan, results: list[RequestResult], drive_s: float) -> dict[str, float]:
    """Split the time ``drive`` took: the arrivals (the plan's last send), then until the last first
    token, then until the last answer ended, then the scrapes and the oracle log after it."""
    last_arrival_s = plan.arrivals[-1].at_s if plan.arrivals else 0.0
    first_tokens = [r.sent_s + r.ttft_ms / 1000.0 for r in results if r.sent_s is not None and r.ttft_ms]
    ends = [r.sent_s + r.total_ms / 1000.0 for r in results if r.sent_s is not None and r.total_ms]
    last_first_s = max([last_arrival_s, *first_tokens])
    last_end_s = max([last_first_s, *ends])
    return {
        "arrivals": last_arrival_s,
        "to_last_first_token": last_first_s - last_arrival_s,
        "answer_tail": last_end_s - last_first_s,
        "after_answers": max(0.0, drive_s - last_end_s),
    }


def run_once(
    spec: RunSpec,
    topology: Topology,
    redis_url: str,
    workdir: Path,
    router: str | None,
    fleets: Fleets | None = None,
) -> RunOutput:
    """One (scenario, policy, seed) run: on ``fleets``' fleet, reset, or on a fleet of its own."""
    phases = Phases()
    own = fleets is None
    fleets = fleets or Fleets(workdir)
    try:
        output = _run_once(spec, topology, redis_url, workdir, router, fleets, phases)
    finally:
        if own:
            fleets.stop()
    output.phases_s = phases.seconds
    return output


# The last plan built: every policy of a (scenario, seed) sends the same one, and mixed-length's
# (352 prompts of up to 8k tokens) took 0.6-2 s to build.
_last_plan: list[tuple[tuple[Any, ...], WorkloadPlan]] = []


def plan_for(spec: RunSpec, regions: list[str]) -> WorkloadPlan:
    warmup = warmup_of(spec)
    shares = spec.scenario.client_shares
    key = (spec.scenario.workload, tuple(regions), spec.rate_rps, spec.requests, warmup, spec.seed)
    key += (tuple(sorted(shares.items())) if shares else None,)
    if _last_plan and _last_plan[0][0] == key:
        return _last_plan[0][1]
    plan = build_plan(
        spec.scenario.workload,
        regions,
        rate_rps=spec.rate_rps,
        # The count ends a run, not the clock: the duration leaves room for Poisson variation.
        duration_s=(spec.requests + warmup) / spec.rate_rps * 1.5,
        max_requests=spec.requests + warmup,
        seed=spec.seed,
        max_tokens=MAX_TOKENS,
        client_shares=shares,
    )
    _last_plan[:] = [(key, plan)]
    return plan


def read_records(
    client: redis.Redis, keys: RedisKeys, expected: int, timeout_s: float = 2.0
) -> list[RequestRecord]:
    """The gateways' request records, once ``expected`` are in (they flush every 50 ms) or after
    ``timeout_s`` (a request refused before any gateway saw it has none)."""
    deadline_s = time.monotonic() + timeout_s
    while client.xlen(keys.request_stream) < expected and time.monotonic() < deadline_s:
        time.sleep(0.02)
    return [decode(fields[b"r"], RequestRecord) for _, fields in client.xrange(keys.request_stream)]


def _run_once(
    spec: RunSpec,
    topology: Topology,
    redis_url: str,
    workdir: Path,
    router: str | None,
    fleets: Fleets,
    phases: Phases,
) -> RunOutput:
    regions = [region.slug for region in topology.regions]
    warmup = warmup_of(spec)
    plan = plan_for(spec, regions)
    phases.lap("plan")
    fleet = fleets.ready(spec.scenario.topology_path)
    phases.lap("fleet_reset")
    procs: list[Proc] = []
    client = redis.Redis.from_url(redis_url)
    prefix = f"gorgobench-rq-{uuid.uuid4().hex[:12]}"
    keys = RedisKeys(prefix=prefix)
    wan: WanRedis | None = None
    api_key: str | None = None
    adapters: gorgo_lb_peer.Adapters | None = None
    try:
        nodes = node_specs(topology, fleet, spec.told_prefill_scale)
        if spec.policy in PEERS:
            assert router is not None
            peer_procs, targets = start_peers(
                workdir, router, fleet, regions, local=spec.policy == PEER_LOCAL
            )
            procs += peer_procs
        elif spec.policy in GORGO_LB:
            configs = gorgo_lb_peer.adapter_configs(
                spec.policy,
                fleet.nodes,
                topology,
                spec.scenario.client_shares,
                # its RouteContext takes one speed and one cache for the fleet: the mean, the least
                prefill_tokens_per_s=fleet_prefill_tokens_per_s(topology),
                kv_capacity_tokens=min(node_engine(n).kv_capacity_tokens for n in topology.nodes),
                seed=spec.seed,
            )
            adapters = gorgo_lb_peer.start_adapters(configs, regions, workdir, spawn, wait_ready)
            procs += adapters.procs
            targets = adapters.targets
        else:
            algorithm, policy_params = GORGO_POLICIES[spec.policy]
            publish_policy(
                client,
                keys,
                topology,
                nodes,
                algorithm,
                {**policy_params, **spec.param_overrides},
                rtt_scale=spec.told_rtt_scale,
            )
            if spec.shared_state == "wan":
                home = home_region(topology, spec.scenario.client_shares)
                wan = start_wan_redis(redis_url, state_rtts_ms(topology, home), workdir, ROOT)
            if spec.front_door:
                api_key = publish_bench_key(client, keys)
            gateway_procs, targets = start_gateways(
                workdir,
                regions,
                redis_url,
                prefix,
                front_door=spec.front_door,
                region_env=wan.gateway_env() if wan is not None else None,
            )
            procs += gateway_procs
        home_targets = dict(targets)
        failover_targets: dict[str, str] = {}
        if spec.policy == PEER_LOCAL and plan.outages:
            delay_procs, failover_targets = start_failover_delays(
                workdir, topology, home_targets, sorted({o.region for o in plan.outages})
            )
            procs += delay_procs

        def on_detected(region: str, healthy: bool) -> None:
            if spec.policy == PEER_LOCAL:  # geo-DNS: the region's clients go to the nearest region
                targets[region] = home_targets[region] if healthy else failover_targets[region]
            elif spec.policy in GORGO_POLICIES:  # the gateways read health from the live state
                mark_health(client, keys, [n.id for n in nodes if n.region == region], healthy)
            # the global vllm-router and gorgo-lb find out by themselves (health checks, scrapes)

        outages = OutageActions(
            fleet.control_url,
            {region: [n.name for n in nodes if n.region == region] for region in regions},
            on_detected,
        )
        node_urls = {node["name"]: node["url"] for node in fleet.nodes}
        phases.lap("routers_start")
        drive_started_s = time.perf_counter()
        results, counters, oracle = asyncio.run(drive(plan, targets, node_urls, warmup, outages, api_key))
        phases.seconds.update(drive_phases(plan, results, time.perf_counter() - drive_started_s))
        phases.lap("drive")
        window_s = plan.arrivals[-1].at_s - plan.arrivals[min(warmup, len(plan.arrivals) - 1)].at_s
        records: list[RequestRecord] = []
        if spec.policy in GORGO_POLICIES:
            records = read_records(client, keys, sum(1 for r in results if r.status))
        regions_of = {n["name"]: n["region"] for n in fleet.nodes}
        phases.lap("records")
        return RunOutput(
            results,
            warmup,
            counters,
            regions_of,
            window_s,
            records,
            oracle_by_index(plan, oracle),
            adapters.state() if adapters else None,
            served_by_index(plan, oracle, topology),
        )
    finally:
        stop_process_groups([proc.popen for proc in procs])
        if wan is not None:
            wan.stop()
        delete_namespace(client, prefix)
        client.close()
        phases.lap("teardown")


# ---- calibration -----------------------------------------------------------------------------


def calibrate(
    scenario: Scenario, probe_rate_rps: float, requests: int, topology: Topology, redis_url: str
) -> dict[str, Any]:
    """Measure least_load's computed prefill per request and derive the rate for the target load."""
    workdir = Path(tempfile.mkdtemp(prefix="gorgo-rq-cal-"))
    output = run_once(
        RunSpec(scenario, "least_load", probe_rate_rps, requests), topology, redis_url, workdir, None
    )
    figures = summarize_run(output, fleet_prefill_tokens_per_s(topology))
    computed_per_request = figures.computed_prefill_tokens / max(1, figures.requests)
    # Utilization grows about linearly with the rate while the hit rate holds; iterate if the
    # suggested rate is far from the probe (the hit rate falls as caches come under pressure).
    rate = probe_rate_rps * TARGET_PREFILL_UTILIZATION / max(figures.prefill_utilization, 1e-6)
    shutil.rmtree(workdir, ignore_errors=True)
    return {
        "workload": scenario.name,
        "probe_rate_rps": probe_rate_rps,
        "requests": figures.requests,
        "computed_prefill_tokens_per_request": round(computed_per_request, 1),
        "prefill_utilization_at_probe": round(figures.prefill_utilization, 3),
        "rate_for_target_rps": round(rate, 2),
        "rate_used_rps": round(min(rate, HARNESS_MAX_RATE_RPS), 2),
    }


# ---- main ------------------------------------------------------------------------------------


def parse_client_shares(text: str) -> dict[str, float]:
    """``us-east=0.4,eu-central=0.3`` -> {region: share}; ``ValueError`` naming a bad item."""
    shares: dict[str, float] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        region, sep, raw = item.partition("=")
        try:
            shares[region.strip()] = float(raw)
        except ValueError:
            raise ValueError(f"--client-share expects REGION=SHARE, got {item!r}") from None
        if not sep or not region.strip():
            raise ValueError(f"--client-share expects REGION=SHARE, got {item!r}")
    return shares


def param_overrides_of(items: list[str]) -> dict[str, float | bool]:
    """``NAME=VALUE`` items as policy parameters: true/false a switch (e.g. measured_inputs), else a number."""
    overrides: dict[str, float | bool] = {}
    for name, _, value in (item.partition("=") for item in items):
        lowered = value.strip().lower()
        overrides[name] = lowered == "true" if lowered in ("true", "false") else float(value)
    return overrides


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK_REQUESTS_PER_RUN} requests per run, one seed, policies {', '.join(QUICK_POLICIES)}",
    )
    parser.add_argument(
        "--workloads",
        default=",".join(DEFAULT_SCENARIOS),
        help=f"comma-separated scenarios, of {', '.join(SCENARIOS)}",
    )
    parser.add_argument(
        "--policies",
        default=None,
        help=f"comma-separated subset of {', '.join((*GORGO_POLICIES, *PEERS, *GORGO_LB))} (default: {', '.join(DEFAULT_POLICIES)})",
    )
    parser.add_argument(
        "--topology", default=None, help="topology file for every scenario (simulator format)"
    )
    parser.add_argument(
        "--client-share",
        default=None,
        metavar="REGION=SHARE,...",
        help="client mix for every scenario (normalised; regions left out send nothing)",
    )
    parser.add_argument(
        "--requests", type=int, default=None, help=f"measured requests per run ({REQUESTS_PER_RUN})"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help=f"arrivals sent before the measured ones ({WARMUP_SHARE * 100:.0f}%% of --requests); a longer "
        "warm-up measures a fleet that has been running, not one that just started cold",
    )
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="workload seeds, comma-separated")
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set a policy parameter where the policy has it, e.g. w_displacement=0.5 (sensitivity runs)",
    )
    parser.add_argument(
        "--rate", type=float, default=None, help="arrival rate for every scenario (exploration)"
    )
    parser.add_argument("--no-peer", action="store_true", help=f"skip {PEER} even if installed")
    parser.add_argument(
        "--shared-state",
        default="loopback",
        help="comma-separated, of loopback (Redis beside every gateway) and wan (Redis in the region "
        "with the most clients, the others' gateways through their RTT to it; reported as "
        f"<workload>{WAN_SUFFIX}); gateway policies only (benchmarks/wan_state.py)",
    )
    parser.add_argument(
        "--front-door",
        action="store_true",
        help="gateways with the front door on and one client key with rate and max_concurrent limits",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="one report of everything at this path, without extension (default: one per workload, "
        "--out-dir; var/routing_quality_quick with --quick)",
    )
    parser.add_argument(
        "--out-dir",
        default=None,
        help="one report per workload in this directory, each written when its workload is done "
        "(the default without --out: benchmarks/results/routing_quality)",
    )
    parser.add_argument(
        "--raw",
        default=None,
        help="also write every request's result to DIR/<workload>-<policy>-<seed>.jsonl (its time at "
        "its node beside its bound's to ....served.json, and the gateways' request records, their "
        "decisions' cost terms, to ....records.jsonl)",
    )
    parser.add_argument(
        "--fresh-fleet",
        action="store_true",
        help="a new fleet process for every run instead of one reset between runs (the harness "
        "before fleet reuse: to check that reuse changes no figure)",
    )
    parser.add_argument(
        "--calibrate", action="store_true", help="measure the rates instead (least_load at --probe-rate)"
    )
    parser.add_argument("--probe-rate", type=float, default=10.0, help="arrival rate of a --calibrate run")
    args = parser.parse_args(argv)
    if args.warmup is not None and args.warmup < 0:
        parser.error("--warmup: a number of arrivals, 0 or more")
    return args


def describe_fleet(scenario: Scenario, topology: Topology, rate: float) -> dict[str, Any]:
    """What actually ran: the markdown's fleet section."""
    shares = scenario.client_shares or {r.slug: 1.0 for r in topology.regions}
    shares = check_client_shares(tuple(r.slug for r in topology.regions), shares)
    return {
        "topology": str(scenario.topology_path.relative_to(ROOT))
        if scenario.topology_path.is_relative_to(ROOT)
        else str(scenario.topology_path),
        "workload": scenario.workload,
        "rate_rps": rate,
        "regions": {
            r.slug: {
                "nodes": sum(1 for n in topology.nodes if n.region == r.slug),
                "client_share": round(shares[r.slug], 3) if scenario.workload != "diurnal" else None,
            }
            for r in topology.regions
        },
        "rtt_ms": {
            f"{a.slug}<->{b.slug}": topology.rtt_ms(a.slug, b.slug)
            for i, a in enumerate(topology.regions)
            for b in topology.regions[i + 1 :]
        },
        **_per_node_or_one(
            "prefill_tokens_per_s_per_node",
            {n.name: round(node_engine(n).prefill_tokens_per_s, 1) for n in topology.nodes},
        ),
        **_per_node_or_one(
            "kv_capacity_tokens", {n.name: node_engine(n).kv_capacity_tokens for n in topology.nodes}
        ),
    }


def _per_node_or_one(name: str, values: dict[str, Any]) -> dict[str, Any]:
    """``{name: value}`` when every node has the same, else ``{name: {node: value}}``."""
    distinct = set(values.values())
    return {name: next(iter(distinct))} if len(distinct) == 1 else {name: values}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()  # the finally blocks stop the fleet, gateways and routers it started
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    redis.Redis.from_url(redis_url).ping()  # fail early with a clear error
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown:
        raise SystemExit(f"unknown workload(s) {unknown}; choose from {', '.join(SCENARIOS)}")
    try:
        shares = parse_client_shares(args.client_share) if args.client_share else None
        scenarios: list[tuple[Scenario, Topology]] = []
        for name in names:
            scenario = SCENARIOS[name]
            if args.topology:
                scenario = dataclasses.replace(
                    scenario, topology_path=Path(args.topology).resolve(), client_shares=None
                )
            if shares is not None:
                scenario = dataclasses.replace(scenario, client_shares=shares)
            topology = load_topology(scenario.topology_path)
            if scenario.client_shares:
                check_client_shares(tuple(r.slug for r in topology.regions), scenario.client_shares)
            scenarios.append((scenario, topology))
        seeds = [int(seed) for seed in args.seeds.split(",") if seed.strip()]
    except (ValueError, OSError) as exc:
        raise SystemExit(f"error: {exc}") from None
    if args.calibrate:
        for scenario, topology in scenarios:
            print(
                json.dumps(calibrate(scenario, args.probe_rate, args.requests or 600, topology, redis_url)),
                flush=True,
            )
        return 0

    requests = args.requests or (QUICK_REQUESTS_PER_RUN if args.quick else REQUESTS_PER_RUN)
    if args.quick:
        seeds = seeds[:1]
    router = None if args.no_peer else find_peer()
    if args.policies:
        policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    else:
        policies = list(QUICK_POLICIES if args.quick else DEFAULT_POLICIES)
    unknown = sorted(set(policies) - {*GORGO_POLICIES, *PEERS, *GORGO_LB})
    if unknown:
        raise SystemExit(f"unknown policy(ies) {unknown}")
    shared_states = [state.strip() for state in args.shared_state.split(",") if state.strip()]
    if not shared_states or set(shared_states) - set(SHARED_STATES):
        raise SystemExit(f"--shared-state: comma-separated, of {', '.join(SHARED_STATES)}")
    notes: list[str] = []
    param_overrides = param_overrides_of(args.param)
    if param_overrides:
        notes.append(f"policy parameters overridden: {param_overrides}")
    if router is None and any(p in PEERS for p in policies):
        policies = [p for p in policies if p not in PEERS]
        notes.append(
            f"{PEER} skipped: not installed (`pip install -e '.[peers]'`)"
            if not args.no_peer
            else f"{PEER} skipped (--no-peer)"
        )
    if not gorgo_lb_peer.installed() and any(p in GORGO_LB for p in policies):
        policies = [p for p in policies if p not in GORGO_LB]
        notes.append("gorgo-lb skipped: not installed (`pip install -e '.[peers]'`)")
    # The committed run (no --out, not --quick): one report per workload in RESULTS_DIR (or
    # --out-dir), each written as soon as its workload is done. --out PATH: one report at PATH.
    if args.out and args.out_dir:
        raise SystemExit("error: --out and --out-dir exclude each other")
    per_workload = bool(args.out_dir) or (not args.out and not args.quick)
    out_dir = Path(args.out_dir) if args.out_dir else RESULTS_DIR
    out = Path(args.out) if args.out else ROOT / "var" / "routing_quality_quick"
    (out_dir if per_workload else out.parent).mkdir(parents=True, exist_ok=True)

    workdir = Path(tempfile.mkdtemp(prefix="gorgo-rq-"))
    campaign = Campaign(
        args,
        seeds,
        policies,
        shared_states,
        requests,
        param_overrides,
        redis_url,
        workdir,
        router,
        Fleets(workdir),
        notes,
    )
    started_s = time.perf_counter()
    written: list[Path] = []
    try:
        for scenario, topology in scenarios:
            scenario_started_s = time.perf_counter()
            run_scenario(campaign, scenario, topology)
            if per_workload:
                names = (scenario.name, scenario.name + WAN_SUFFIX)
                written += write_report(
                    out_dir / scenario.name,
                    describe_run(
                        campaign,
                        argv,
                        time.perf_counter() - scenario_started_s,
                        {n: f for n, f in campaign.fleets.items() if n in names},
                    ),
                    {n: r for n, r in campaign.runs.items() if n in names},
                    {n: r for n, r in campaign.shared_state_rtts.items() if n == scenario.name},
                    campaign,
                )
    finally:
        campaign.emulated.stop()
    duration_s = time.perf_counter() - started_s
    if not per_workload:
        written += write_report(
            out,
            describe_run(campaign, argv, duration_s, campaign.fleets),
            campaign.runs,
            campaign.shared_state_rtts,
            campaign,
        )
    print(f"wrote {', '.join(str(p) for p in written)} in {duration_s:.0f}s", flush=True)
    if campaign.failed:
        print(f"process logs kept in {workdir}", flush=True)
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if campaign.failed else 0


@dataclass
class Campaign:
    """What the runs of one invocation share, and what they produce."""

    args: argparse.Namespace
    seeds: list[int]
    policies: list[str]
    shared_states: list[str]
    requests: int
    param_overrides: dict[str, float | bool]
    redis_url: str
    workdir: Path
    router: str | None
    emulated: Fleets
    notes: list[str]
    runs: dict[str, dict[str, list[RunFigures]]] = field(default_factory=dict)
    fleets: dict[str, dict[str, Any]] = field(default_factory=dict)  # scenario -> its fleet's description
    shared_state_rtts: dict[str, dict[str, float]] = field(default_factory=dict)  # scenario -> region -> ms
    failed: bool = False


def run_scenario(campaign: Campaign, scenario: Scenario, topology: Topology) -> None:
    """Every (seed, policy) run of one scenario, into ``campaign.runs``."""
    args, seeds, requests, runs, fleets = (
        campaign.args,
        campaign.seeds,
        campaign.requests,
        campaign.runs,
        campaign.fleets,
    )
    rate = args.rate or scenario_rate(scenario, topology)
    fleets[scenario.name] = describe_fleet(scenario, topology, rate)
    if "wan" in campaign.shared_states:
        home = home_region(topology, scenario.client_shares)
        campaign.shared_state_rtts[scenario.name] = state_rtts_ms(topology, home)
        fleets[scenario.name + WAN_SUFFIX] = {
            **fleets[scenario.name],
            "redis_region": home,
            "shared_state_rtt_ms": campaign.shared_state_rtts[scenario.name],
        }
    for seed in seeds:
        # Rounds taken in turns (loopback, then WAN, per policy) so machine noise hits both.
        for policy, shared_state in (
            (policy, state)
            for policy in campaign.policies
            for state in campaign.shared_states
            if state == "loopback" or policy not in PEERS  # routers do not use Redis
        ):
            if (
                policy in OVERFLOW_ONLY_POLICIES
                and scenario.name not in OVERFLOW_SCENARIOS
                and not args.policies
            ):
                continue
            name = scenario.name + (WAN_SUFFIX if shared_state == "wan" else "")
            print(
                f"{name:>13} seed {seed} {policy:<22} {requests} requests at {rate:g}/s ...",
                end=" ",
                flush=True,
            )
            run_started_s = time.perf_counter()
            try:
                output = run_once(
                    RunSpec(
                        scenario,
                        policy,
                        rate,
                        requests,
                        seed,
                        campaign.param_overrides,
                        shared_state=shared_state,
                        front_door=args.front_door,
                        warmup_requests=args.warmup,
                    ),
                    topology,
                    campaign.redis_url,
                    campaign.workdir,
                    campaign.router,
                    None if args.fresh_fleet else campaign.emulated,
                )
            except Exception as exc:  # a run that cannot start is reported; the others go on
                campaign.failed = True
                print(f"FAILED: {exc}", flush=True)
                campaign.notes.append(f"{name}/{policy}/seed {seed} failed: {str(exc)[:300]}")
                continue
            figures = summarize_run(output, fleet_prefill_tokens_per_s(topology))
            figures.phases_s = output.phases_s
            runs.setdefault(name, {}).setdefault(policy, []).append(figures)
            if args.raw:
                raw_dir = Path(args.raw)
                raw_dir.mkdir(parents=True, exist_ok=True)
                with (raw_dir / f"{name}-{policy}-{seed}.jsonl").open("wb") as raw:
                    raw.writelines(msgspec.json.encode(result) + b"\n" for result in output.results)
                # ... and each request's time at its node beside its bound's (``Served``), by index
                (raw_dir / f"{name}-{policy}-{seed}.served.json").write_text(
                    json.dumps({str(index): dataclasses.asdict(at) for index, at in output.served.items()})
                )
                if output.records:  # the gateways' decisions, cost terms and all
                    with (raw_dir / f"{name}-{policy}-{seed}.records.jsonl").open("wb") as raw:
                        raw.writelines(msgspec.json.encode(record) + b"\n" for record in output.records)
            print(
                f"p50 {figures.ttft_p50_ms:.0f} p99 {figures.ttft_p99_ms:.0f} ms"
                f" (oracle p50 {figures.oracle_p50_ms or 0:.0f}), hit {figures.prefix_hit_rate:.0%},"
                f" cross {figures.cross_region_share:.0%}, errors {figures.errors},"
                f" util {figures.prefill_utilization:.0%}, send lag p99 {figures.send_lag_p99_ms:.0f} ms"
                f" ({time.perf_counter() - run_started_s:.0f}s:"
                f" {', '.join(f'{k} {v:.1f}' for k, v in output.phases_s.items())})",
                flush=True,
            )


def describe_run(
    campaign: Campaign, argv: list[str] | None, duration_s: float, fleets: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """The report's ``meta`` (``fleets``: the scenarios it covers)."""
    args, router = campaign.args, campaign.router
    return {
        "command": "python benchmarks/routing_quality.py" + (" " + " ".join(argv or sys.argv[1:])).rstrip(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": f"{platform.platform()}, Python {platform.python_version()}, {os.cpu_count()} CPUs",
        "duration_s": round(duration_s, 1),
        "requests_per_run": campaign.requests,
        "warmup_requests": warmup_count(campaign.requests, args.warmup),
        "seeds": campaign.seeds,
        "max_tokens": MAX_TOKENS,
        "rates_rps": {name: fleet["rate_rps"] for name, fleet in fleets.items()},
        "fleets": fleets,
        "target_prefill_utilization": TARGET_PREFILL_UTILIZATION,
        "harness_max_rate_rps": HARNESS_MAX_RATE_RPS,
        "detection_s": DETECTION_S,
        "engine": dict(ENGINE_OVERRIDES),
        "rtt_source": "RTTTable published to live_rtt from the topology (RTT + mean jitter)",
        "peer": {"name": PEER, "policy": "cache_aware", "path": router} if router else None,
        "gorgo_lb": gorgo_lb_peer.describe() if gorgo_lb_peer.installed() else None,
        "notes": list(campaign.notes),
        "quick": args.quick,
        "front_door": args.front_door,
        "load_average": os.getloadavg(),
        # How each run's processes and traffic were handled (docs: benchmarks/README.md).
        "harness": {
            **HARNESS,
            **({"fleet": "a new process per run (--fresh-fleet)"} if args.fresh_fleet else {}),
        },
    }


def write_report(
    out: Path,
    meta: dict[str, Any],
    runs: dict[str, dict[str, list[RunFigures]]],
    shared_state_rtts: dict[str, dict[str, float]],
    campaign: Campaign,
) -> list[Path]:
    """``out``.json, .md and .png (``routing_quality_report.write_outputs``), with the shared-state
    summary when Redis ran over the WAN."""
    if shared_state_rtts:
        summary = wan_summary(runs, shared_state_rtts)
        meta["shared_state"] = {
            "modes": campaign.shared_states,
            "shared_state_rtt_ms": shared_state_rtts,  # scenario -> region -> RTT to Redis
            "summary": summary,
        }
    paths = write_outputs(out, meta, runs)
    if shared_state_rtts:
        md_path = out.with_suffix(".md")
        md_path.write_text(
            md_path.read_text() + "\n" + "\n".join(summary_markdown(summary, campaign.args.front_door)) + "\n"
        )
    return paths


if __name__ == "__main__":
    sys.exit(main())
