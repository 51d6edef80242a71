"""Probe workers pick up regions added later without a restart, and nothing piles up in Redis.

Real processes: a migrated control plane (API), a Celery worker and beat on its database. Before,
a worker consumed the probe queues it was started with; a region added later got a queue nobody
read (142 queues, 3,958 messages after a while) and the docs said "restart".
"""

from __future__ import annotations

import httpx
import pytest
import redis

from tests.conftest import ControlPlane, ProcessGroup, free_port, start_celery
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

INTERVAL_S = "0.5"


def add_region(api: httpx.Client, slug: str, node_port: int) -> None:
    region = {"slug": slug, "name": slug, "latitude": 10.0, "longitude": 10.0}
    assert api.post("/regions/", json=region).status_code == 201
    node = {"name": f"{slug}-1", "region": slug, "base_url": f"http://127.0.0.1:{node_port}"}
    assert api.post("/nodes/", json=node).status_code == 201


def probed_from(api: httpx.Client, slug: str) -> int:
    return api.get("/telemetry/rtt-samples/", params={"region": slug, "limit": 1}).json()["count"]


def start_worker_and_beat(processes: ProcessGroup, prefix: str, probe_regions: str) -> None:
    env = {
        "GORGO_PROBE_INTERVAL_S": INTERVAL_S,
        "GORGO_PROBE_REGIONS": probe_regions,
        "GORGO_PROBE_TIMEOUT_S": "0.3",
    }
    start_celery(processes, prefix, env, concurrency=4)


def queue_lengths(client: redis.Redis, prefix: str) -> dict[str, int]:
    return {
        key.decode(): client.llen(key)
        for key in client.scan_iter(match=f"{prefix}:celery:probe.*", count=500)
        if client.type(key) == b"list"
    }


def test_a_worker_probes_from_a_region_added_after_it_started(
    control_plane: ControlPlane, processes: ProcessGroup, redis_url: str
) -> None:
    prefix = control_plane.env["GORGO_REDIS_PREFIX"]
    client = redis.Redis.from_url(redis_url)
    with control_plane.api() as api:
        add_region(api, "us-east", free_port())
        start_worker_and_beat(processes, prefix, "*")
        wait_until(
            lambda: probed_from(api, "us-east") > 0, 30.0, what="probes from us-east", describe=processes.logs
        )

        add_region(api, "eu-west", free_port())  # the worker is running: no restart
        wait_until(
            lambda: probed_from(api, "eu-west") > 0, 30.0, what="probes from eu-west", describe=processes.logs
        )
        # Let three more probe rounds run (two nodes each), counted rather than slept for, so
        # anything a stale queue would pile up has had the time to show.
        later = probed_from(api, "eu-west") + 3 * 2
        wait_until(
            lambda: probed_from(api, "eu-west") >= later,
            30.0,
            what="three more rounds from eu-west",
            describe=processes.logs,
        )
        assert all(length <= 2 for length in queue_lengths(client, prefix).values()), queue_lengths(
            client, prefix
        )
    assert "probing from eu-west now" in processes.processes["worker"].log()


def test_a_region_no_worker_probes_from_gets_no_messages(
    control_plane: ControlPlane, processes: ProcessGroup, redis_url: str
) -> None:
    prefix = control_plane.env["GORGO_REDIS_PREFIX"]
    client = redis.Redis.from_url(redis_url)
    with control_plane.api() as api:
        add_region(api, "us-east", free_port())
        add_region(api, "eu-west", free_port())
        start_worker_and_beat(processes, prefix, "us-east")  # a worker that probes from us-east only
        wait_until(
            lambda: probed_from(api, "us-east") > 5, 30.0, what="probes from us-east", describe=processes.logs
        )
        assert probed_from(api, "eu-west") == 0
    assert client.llen(f"{prefix}:celery:probe.eu-west") == 0
