"""Two API writers and a worker on the default SQLite database: no 500s, no lost fleet change.

Real processes on one SQLite file: two uvicorn web processes (each a writer), a Celery worker
that publishes the coalesced fleet changes, and beat running the reconcile every second. One
client edits and publishes the policy through web 1 while another drains, enables and edits
nodes through web 2, at once. Before WAL, a busy timeout and IMMEDIATE transactions, 27 of 100
publishes and 8 of 100 PATCHes answered 500 "database is locked".
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis

from routing import contract
from routing.contract import PolicySnapshot, RedisKeys
from tests.conftest import ControlPlane, ProcessGroup, free_port, start_celery

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

ROUNDS = 40  # per writer: bounded in count ...
DEADLINE_S = 90.0  # ... and in time


def api(url: str, token: str) -> httpx.Client:
    return httpx.Client(base_url=f"{url}/api/v1", headers={"Authorization": f"Token {token}"}, timeout=30.0)


def policy_writer(url: str, token: str, policy_id: int, deadline: float) -> Counter:
    statuses: Counter = Counter()
    with api(url, token) as client:
        for index in range(ROUNDS):
            if time.monotonic() > deadline:
                break
            edit = client.patch(f"/policies/{policy_id}/", json={"params": {"w_rtt": 1.0 + index / 100}})
            published = client.post(f"/policies/{policy_id}/publish/", json={"note": f"round {index}"})
            statuses.update([f"patch {edit.status_code}", f"publish {published.status_code}"])
    return statuses


def fleet_writer(url: str, token: str, node_ids: list[int], deadline: float) -> Counter:
    statuses: Counter = Counter()
    with api(url, token) as client:
        for index in range(ROUNDS):
            if time.monotonic() > deadline:
                break
            node = node_ids[index % len(node_ids)]
            action = "drain" if index % 2 == 0 else "enable"
            moved = client.post(f"/nodes/{node}/{action}/")
            edited = client.patch(f"/nodes/{node}/", json={"prefill_tokens_per_s": 10000.0 + index})
            statuses.update([f"{action} {moved.status_code}", f"patch {edited.status_code}"])
    return statuses


def test_two_writers_and_the_worker_never_get_a_500(
    control_plane: ControlPlane, processes: ProcessGroup, redis_url: str
) -> None:
    control_plane.manage("seed_demo")
    fast = {"GORGO_REPUBLISH_DELAY_S": "0.5", "GORGO_RECONCILE_INTERVAL_S": "1"}
    port = free_port()
    second = f"http://127.0.0.1:{port}"
    processes.start(
        "web-2",
        [sys.executable, "-m", "uvicorn", "controlplane.asgi:application", "--port", str(port)],
        env=fast,
        ready_url=f"{second}/login/",
    )
    # The first web process runs with the fixture's settings; the fleet writer uses the second.
    prefix = control_plane.env["GORGO_REDIS_PREFIX"]
    start_celery(processes, prefix, fast, concurrency=2)
    with api(control_plane.url, control_plane.token) as client:
        policy_id = client.get("/policies/", params={"name": "default"}).json()["results"][0]["id"]
        node_ids = [n["id"] for n in client.get("/nodes/").json()["results"]][:4]

    deadline = time.monotonic() + DEADLINE_S
    with ThreadPoolExecutor(max_workers=2) as pool:
        policies = pool.submit(policy_writer, control_plane.url, control_plane.token, policy_id, deadline)
        fleet = pool.submit(fleet_writer, second, control_plane.token, node_ids, deadline)
        statuses = policies.result() + fleet.result()
    sys.stdout.write(f"concurrent writers: {dict(sorted(statuses.items()))}\n")
    assert not [status for status in statuses if status.endswith(("500", "502", "503"))], statuses
    assert sum(statuses.values()) >= 4 * min(ROUNDS, 10)

    # The worker publishes the last fleet change: the live snapshot ends with the fleet as it is.
    keys = RedisKeys(prefix=prefix)
    client = redis.Redis.from_url(redis_url)
    with api(control_plane.url, control_plane.token) as reader:
        expected = {
            n["name"]: (n["state"], n["prefill_tokens_per_s"])
            for n in reader.get("/nodes/").json()["results"]
        }
    give_up = time.monotonic() + 30
    while True:
        snapshot = contract.decode(client.get(keys.policy_current), PolicySnapshot)
        live = {n.name: (n.state, n.prefill_tokens_per_s) for n in snapshot.nodes}
        if live == expected or time.monotonic() > give_up:
            break
        time.sleep(0.3)
    assert live == expected, processes.logs()
    assert "database is locked" not in processes.logs()


PUBLISHES = 50  # per client: bounded in count (and by DEADLINE_S in time)
RACE_RUNS = 3


def publisher(url: str, token: str, policy_id: int, deadline: float) -> Counter:
    statuses: Counter = Counter()
    with api(url, token) as client:
        for index in range(PUBLISHES):
            if time.monotonic() > deadline:
                break
            answer = client.post(f"/policies/{policy_id}/publish/", json={"note": f"race {index}"})
            statuses[f"publish {answer.status_code}"] += 1
            if answer.status_code == 409:
                assert "retry" in answer.json()["detail"].lower(), answer.text
    return statuses


def editor(url: str, token: str, policy_id: int, deadline: float) -> Counter:
    statuses: Counter = Counter()
    with api(url, token) as client:
        for index in range(PUBLISHES):
            if time.monotonic() > deadline:
                break
            answer = client.patch(f"/policies/{policy_id}/", json={"description": f"edit {index}"})
            statuses[f"patch {answer.status_code}"] += 1
    return statuses


def active_policies(url: str, token: str) -> list[int]:
    with api(url, token) as client:
        return [
            p["id"]
            for p in client.get("/policies/", params={"limit": 1000}).json()["results"]
            if p["is_active"]
        ]


def live_policy_id(redis_url: str, prefix: str) -> int:
    raw = redis.Redis.from_url(redis_url).get(RedisKeys(prefix=prefix).policy_current)
    return contract.decode(raw, PolicySnapshot).policy.id


def test_racing_publishes_and_edits_leave_exactly_the_live_policy_active(
    control_plane: ControlPlane, processes: ProcessGroup, redis_url: str
) -> None:
    """Two clients publishing two policies 50 times each, then PATCH-vs-publish 3 times: never a
    500, a lost race is a 409 that says to retry, and the database ends with exactly one active
    policy, the one the gateways run. Before: 18 x 500 (one_active_policy), 15 x 400 naming the
    constraint, and PATCH-vs-publish ended with no policy active."""
    control_plane.manage("seed_demo")
    port = free_port()
    second = f"http://127.0.0.1:{port}"
    processes.start(
        "web-2",
        [sys.executable, "-m", "uvicorn", "controlplane.asgi:application", "--port", str(port)],
        ready_url=f"{second}/login/",
    )
    url, token, prefix = control_plane.url, control_plane.token, control_plane.env["GORGO_REDIS_PREFIX"]
    with api(url, token) as client:
        first = client.get("/policies/", params={"name": "default"}).json()["results"][0]
        other = client.post(
            "/policies/", json={"name": "race-b", "algorithm": "least_load", "params": {}}
        ).json()
    a, b = first["id"], other["id"]

    deadline = time.monotonic() + DEADLINE_S
    with ThreadPoolExecutor(max_workers=2) as pool:
        one = pool.submit(publisher, url, token, a, deadline)
        two = pool.submit(publisher, second, token, b, deadline)
        statuses = one.result() + two.result()
    finals = [(active_policies(url, token), live_policy_id(redis_url, prefix))]

    for _run in range(RACE_RUNS):
        # The editor edits the policy that is active now while the other one is published.
        active = finals[-1][0][0]
        other_id = b if active == a else a
        with ThreadPoolExecutor(max_workers=2) as pool:
            edits = pool.submit(editor, url, token, active, deadline)
            publishes = pool.submit(publisher, second, token, other_id, deadline)
            statuses += edits.result() + publishes.result()
        finals.append((active_policies(url, token), live_policy_id(redis_url, prefix)))

    sys.stdout.write(f"racing writers: {dict(sorted(statuses.items()))}; active vs live: {finals}\n")
    assert not [s for s in statuses if s.endswith(("400", "500", "502", "503"))], statuses
    for active, live in finals:
        assert active == [live], finals
    assert statuses["publish 201"] + statuses["publish 200"] >= PUBLISHES
