"""End to end: a real Celery worker and beat (not eager) against emulated vLLM nodes on loopback.

Processes: two simulator processes (the node we kill runs alone), a migrated temporary SQLite file
(a copy of the session's, tests/conftest.py) shared with the worker, a Celery worker consuming the
default queue and every region's probe queue (threads pool), and beat with one-second intervals. The test reads
what the workers wrote: Redis live state (as a gateway would) and the database file.
"""

from __future__ import annotations

import os
import random
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis

from routing import contract
from routing.contract import REQUEST_STREAM_FIELD, NodeLiveState, RedisKeys, RTTTable
from simulator.topology import DEFAULT_TOPOLOGY_PATH, load_topology
from tests.conftest import ROOT, ProcessGroup, delete_namespace, migrated_sqlite
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
REGIONS = ("us-east", "eu-central", "ap-south")
INTERVAL_S = "1"

SEED = """
from controlplane.fleet.models import LLMModel, Node, Region
from simulator.topology import load_topology
topology = load_topology({topology!r})
model = LLMModel.objects.create(name={model!r})
for region in topology.regions:
    Region.objects.create(slug=region.slug, name=region.name, latitude=region.latitude, longitude=region.longitude)
for name, url in {urls!r}.items():
    node = Node.objects.create(name=name, region=Region.objects.get(slug=topology.node(name).region), base_url=url)
    node.served_models.add(model)
"""


def node_urls(log: str) -> dict[str, str]:
    urls = {}
    for line in log.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[2].startswith("http://"):
            urls[parts[0]] = parts[2]
    return urls


@pytest.fixture
def stack(processes: ProcessGroup, tmp_path: Path, redis_url: str) -> Iterator[dict]:
    keys = RedisKeys(prefix=f"gorgotest-{uuid.uuid4().hex}")
    db_path = tmp_path / "db.sqlite3"
    processes.env.update(
        {
            "DJANGO_SETTINGS_MODULE": "controlplane.settings",
            "DEBUG": "true",
            "REDIS_URL": redis_url,
            "DATABASE_URL": f"sqlite:///{db_path}",
            "GORGO_REDIS_PREFIX": keys.prefix,
            "GORGO_PROBE_INTERVAL_S": INTERVAL_S,
            "GORGO_SCRAPE_INTERVAL_S": INTERVAL_S,
            "GORGO_AGGREGATE_INTERVAL_S": INTERVAL_S,
            "GORGO_PROBE_TIMEOUT_S": "1.5",
            "GORGO_SCRAPE_TIMEOUT_S": "1.5",
            "LOG_LEVEL": "INFO",
        }
    )
    python = sys.executable
    sim = [python, "-m", "simulator", "--topology", str(DEFAULT_TOPOLOGY_PATH), "--auto-ports", "--only"]
    survivors = processes.start("sim-main", [*sim, "us-east-1,eu-central-1"], ready_text="simulator ready")
    victim = processes.start("sim-victim", [*sim, "ap-south-1"], ready_text="simulator ready")
    urls = node_urls(survivors.log()) | node_urls(victim.log())
    assert set(urls) == {"us-east-1", "eu-central-1", "ap-south-1"}

    run = {"cwd": ROOT, "env": {**os.environ, **processes.env}, "check": True, "capture_output": True}
    migrated_sqlite(db_path)  # what `manage.py migrate` would write
    seed = SEED.format(topology=str(DEFAULT_TOPOLOGY_PATH), model=MODEL, urls=urls)
    subprocess.run([python, "manage.py", "shell", "-c", seed], timeout=60, **run)
    queues = subprocess.run(
        [python, "manage.py", "telemetry_queues"], timeout=60, text=True, **run
    ).stdout.strip()

    celery = [python, "-m", "celery", "-A", "controlplane"]
    processes.start(
        "worker",
        [
            *celery,
            "worker",
            "-Q",
            queues,
            "--pool=threads",
            "--concurrency=6",
            "-n",
            f"{keys.prefix}@%h",
            "--without-gossip",
            "--without-mingle",
            "--loglevel=INFO",
        ],
        ready_text="ready.",
        timeout_s=60,
    )
    processes.start(
        "beat",
        [*celery, "beat", "-s", str(tmp_path / "beat-schedule"), "--loglevel=INFO"],
        ready_text="Starting",
    )
    client = redis.Redis.from_url(redis_url)
    yield {"keys": keys, "redis": client, "db": db_path, "urls": urls, "processes": processes}
    processes.stop_all()
    delete_namespace(client, keys.prefix)
    client.close()


def query(db_path: Path, sql: str, *params) -> list[tuple]:
    with sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=20) as connection:
        return connection.execute(sql, params).fetchall()


def live_state(stack: dict) -> tuple[dict[str, NodeLiveState], RTTTable | None]:
    client, keys = stack["redis"], stack["keys"]
    ids = dict(query(stack["db"], "SELECT id, name FROM fleet_node"))
    nodes = {
        ids[int(node_id)]: contract.decode(raw, NodeLiveState)
        for node_id, raw in client.hgetall(keys.live_nodes).items()
    }
    raw_table = client.get(keys.live_rtt)
    return nodes, contract.decode(raw_table, RTTTable) if raw_table else None


def chat(url: str, prompt: str) -> None:
    response = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 4},
        timeout=30.0,
    )
    response.raise_for_status()


def test_real_workers_measure_the_emulated_fleet(stack):
    processes, db = stack["processes"], stack["db"]
    topology = load_topology(DEFAULT_TOPOLOGY_PATH)
    names = dict(query(db, "SELECT id, name FROM fleet_node"))
    node_region = {name: topology.node(name).region for name in names.values()}

    # 1. The RTT matrix: every region has probed every node a few times.
    def full_matrix() -> RTTTable | None:
        _nodes, table = live_state(stack)
        if table and len([e for e in table.entries if e.samples >= 3]) == len(REGIONS) * len(names):
            return table
        return None

    table = wait_until(full_matrix, 60, what="a full RTT matrix", interval_s=0.2, describe=processes.logs)
    expected_values = sorted({topology.rtt_ms(a, b) for a in REGIONS for b in REGIONS})
    for entry in table.entries:
        expected = topology.rtt_ms(entry.region, node_region[names[entry.node_id]])
        assert entry.rtt_ms >= expected, entry  # the emulated delay is a floor
    medians = query(
        db,
        "SELECT r.slug, n.name, s.rtt_ms FROM telemetry_rttsample s JOIN fleet_region r ON r.id = s.region_id "
        "JOIN fleet_node n ON n.id = s.node_id WHERE s.ok = 1",
    )
    by_pair: dict[tuple[str, str], list[float]] = {}
    for region, name, rtt_ms in medians:
        by_pair.setdefault((region, name), []).append(rtt_ms)
    assert len(by_pair) == 9
    for (region, name), samples in by_pair.items():
        expected = topology.rtt_ms(region, node_region[name])
        assert sorted(samples)[len(samples) // 2] >= expected
        # Each pair's fastest probe is closer to its own matrix cell than to any other RTT of the
        # topology. The fastest, not the median or the table's value: a busy machine only ever adds
        # delay (scheduling, a full loop), so under load a median drifted toward the next cell up.
        assert min(expected_values, key=lambda v: abs(v - min(samples))) == expected, (region, name, samples)

    # 2. Prefix-cache hit rate rises when prompts repeat.
    url = stack["urls"]["us-east-1"]
    rng = random.Random(7)

    def prompt() -> str:
        return " ".join(f"w{rng.randrange(10**6)}" for _ in range(600))

    started = time.time()
    for _ in range(3):
        chat(url, prompt())

    def hit_rate_after(since: float, predicate: Callable[[float], bool]) -> tuple[float] | None:
        """The live hit rate once a scrape after ``since`` set one matching ``predicate`` (0.0 is a value)."""
        state = live_state(stack)[0]["us-east-1"]
        rate = state.prefix_hit_rate
        fresh = state.last_scrape_at is not None and state.last_scrape_at > since
        return (rate,) if fresh and rate is not None and predicate(rate) else None

    (low,) = wait_until(
        lambda: hit_rate_after(started, lambda r: True),
        20,
        what="a scrape of the unique prompts",
        interval_s=0.2,
        describe=processes.logs,
    )
    repeated = prompt()
    started = time.time()
    for _ in range(6):
        chat(url, repeated)
    (high,) = wait_until(
        lambda: hit_rate_after(started, lambda r: r > 0.5),
        20,
        what="a high hit rate",
        interval_s=0.2,
        describe=processes.logs,
    )
    assert low < 0.3 < 0.5 < high
    rates = [
        r
        for (r,) in query(
            db,
            "SELECT prefix_hit_rate FROM telemetry_metricsample s JOIN fleet_node n "
            "ON n.id = s.node_id WHERE n.name = 'us-east-1' AND prefix_hit_rate IS NOT NULL "
            "ORDER BY s.ts",
        )
    ]
    assert rates[-1] > 0.5 and min(rates) < 0.3

    # 3. The request stream is aggregated by the worker.
    us_east_1 = next(pk for pk, name in names.items() if name == "us-east-1")
    record = contract.RequestRecord(
        schema_version=contract.SCHEMA_VERSION,
        request_id=uuid.uuid4().hex,
        ts=time.time(),
        gateway_region="eu-central",
        gateway_id="gw-test",
        model=MODEL,
        status=200,
        stream=True,
        node_id=us_east_1,
        gateway_ms=0.5,
        ttft_ms=150.0,
        total_ms=300.0,
    )
    stack["redis"].xadd(stack["keys"].request_stream, {REQUEST_STREAM_FIELD: contract.encode(record)})
    wait_until(
        lambda: query(
            db,
            "SELECT count FROM telemetry_requestaggregate WHERE node_id = ? AND resolution = '10s'",
            us_east_1,
        ),
        20,
        what="the record in the aggregates",
        interval_s=0.2,
        describe=processes.logs,
    )

    # 4. Killing a node marks it unhealthy, and the gateway's eligibility rules drop it.
    killed_at = time.monotonic()
    processes.stop("sim-victim", sig=9)
    wait_until(
        lambda: live_state(stack)[0]["ap-south-1"].healthy is False,
        30,
        what="ap-south-1 unhealthy in live state",
        interval_s=0.2,
        describe=processes.logs,
    )
    seconds_to_unhealthy = time.monotonic() - killed_at
    print(f"\nap-south-1 marked unhealthy {seconds_to_unhealthy:.1f} s after it was killed")
    events = query(
        db,
        "SELECT e.previous, e.current FROM telemetry_healthevent e JOIN fleet_node n ON n.id = e.node_id "
        "WHERE n.name = 'ap-south-1' ORDER BY e.ts",
    )
    assert events[-1] == ("healthy", "unhealthy")
    from routing.state.eligibility import UNHEALTHY, exclusion_reason

    live, _ = live_state(stack)
    victim_id = next(pk for pk, name in names.items() if name == "ap-south-1")
    spec = contract.NodeSpec(
        id=victim_id,
        name="ap-south-1",
        region="ap-south",
        base_url=stack["urls"]["ap-south-1"],
        models=(MODEL,),
        gpu_type="H100",
        gpu_count=1,
        max_num_seqs=256,
        prefill_tokens_per_s=20000.0,
        kv_capacity_tokens=448000,
        state="active",
    )
    policy = contract.PolicySpec(id=1, name="p", algorithm="round_robin", params=contract.RoundRobinParams())
    by_id = {state.node_id: state for state in live.values()}
    assert exclusion_reason(spec, MODEL, policy, None, by_id, {}) == UNHEALTHY
