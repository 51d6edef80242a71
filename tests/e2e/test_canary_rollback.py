"""A deliberately bad canary is rolled back automatically (issue 23), on the emulated fleet.

Real processes on loopback: the control plane (web), a Celery worker and beat, one emulated vLLM
node per region (us-east, eu-central, ap-south; WAN delays emulated at 0.2x time), and a gateway in
us-east. The live policy is gorgo; the canary is the same policy with ``w_rtt = 0``, blind to the
network, so it sends us-east's clients abroad a good part of the time. The test stands in for the
RTT probe workers only (it writes the RTT table the gateway prices with); everything else is the
product: the API starts the canary, the gateway hashes sessions into it, the worker sums the
request log every second and its sequential test rolls the canary back, through a published
version the gateway picks up.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis

from routing.contract import (
    REQUEST_STREAM_FIELD,
    SCHEMA_VERSION,
    RedisKeys,
    RequestRecord,
    RTTEntry,
    RTTTable,
    decode,
    encode,
)
from simulator.harness import wait_until
from tests.conftest import ControlPlane, ProcessGroup, start_celery
from tests.routing.support import MODEL
from tests.routing.test_e2e_gateway import start_fleet, start_gateway

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

NODES = {"us-east-1": "us-east", "eu-central-1": "eu-central", "ap-south-1": "ap-south"}
REGIONS = {"us-east": (39.04, -77.49), "eu-central": (50.11, 8.68), "ap-south": (19.08, 72.88)}
RTT_FROM_US_EAST_MS = {"us-east": 1.5, "eu-central": 88.0, "ap-south": 235.0}  # the topology's
SHARE_PERCENT = 20
ROLLBACK_WITHIN_S = 30.0  # the stated bound: from the canary's start to its rollback (an upper limit)
MAX_REQUESTS = 3_000
CLIENTS = 4


def register_fleet(api: httpx.Client, urls: dict[str, str]) -> None:
    for slug, (latitude, longitude) in REGIONS.items():
        body = {"slug": slug, "name": slug, "latitude": latitude, "longitude": longitude}
        assert api.post("/regions/", json=body).status_code == 201
    assert (
        api.post(
            "/models/", json={"name": MODEL, "kv_block_size": 16, "max_context_tokens": 32768}
        ).status_code
        == 201
    )
    for name, region in NODES.items():
        body = {"name": name, "region": region, "base_url": urls[name], "models": [MODEL]}
        assert api.post("/nodes/", json=body).status_code == 201


def write_rtt_table(redis_url: str, keys: RedisKeys, node_ids: dict[str, int]) -> None:
    """What the RTT probe workers (one per region) would have measured from us-east."""
    now = time.time()
    entries = tuple(
        RTTEntry(
            region="us-east",
            node_id=node_id,
            rtt_ms=RTT_FROM_US_EAST_MS[NODES[name]],
            jitter_ms=1.0,
            samples=9,
            updated_at=now,
        )
        for name, node_id in node_ids.items()
    )
    client = redis.Redis.from_url(redis_url)
    client.set(keys.live_rtt, encode(RTTTable(SCHEMA_VERSION, now, entries)))
    client.publish(keys.live_channel, keys.live_rtt)
    client.close()


def test_a_canary_blind_to_the_network_is_rolled_back_having_served_only_its_share(
    control_plane: ControlPlane, processes: ProcessGroup, redis_url: str, redis_keys: RedisKeys
) -> None:
    urls = start_fleet(processes, names=tuple(NODES))
    start_celery(processes, redis_keys.prefix, {"GORGO_EXPERIMENT_INTERVAL_S": "1"}, concurrency=2)
    with control_plane.api() as api:
        register_fleet(api, urls)
        node_ids = {n["name"]: n["id"] for n in api.get("/nodes/").json()["results"]}
        policy = api.post("/policies/", json={"name": "live", "algorithm": "gorgo", "params": {}}).json()
        assert api.post(f"/policies/{policy['id']}/publish/").status_code == 201
        bad = api.post(
            "/policies/", json={"name": "blind", "algorithm": "gorgo", "params": {"w_rtt": 0.0}}
        ).json()
        write_rtt_table(redis_url, redis_keys, node_ids)
        gateway = start_gateway(processes, redis_url, redis_keys)

        stop = threading.Event()
        sequence = itertools.count()
        answers: list[int] = []  # the policy version each answer came with, in order

        def client_loop() -> Counter:
            seen: Counter = Counter()
            with httpx.Client(base_url=gateway, timeout=30) as http:
                while not stop.is_set():
                    index = next(sequence)
                    if index >= MAX_REQUESTS:
                        break
                    answer = http.post(
                        "/v1/chat/completions",
                        json={
                            "model": MODEL,
                            "max_tokens": 4,
                            "messages": [{"role": "user", "content": f"question {index}"}],
                        },
                        headers={"x-session-id": f"session-{index % 400}"},
                    )
                    seen[answer.status_code] += 1
                    answers.append(int(answer.headers.get("x-gorgo-policy-version", "0")))
            return seen

        with ThreadPoolExecutor(max_workers=CLIENTS) as pool:
            loops = [pool.submit(client_loop) for _ in range(CLIENTS)]
            wait_until(lambda: len(answers) >= 40, 20, what="live traffic before the canary")
            started = api.post(
                "/policy-experiments/",
                json={
                    "kind": "canary",
                    "policy": bad["id"],
                    "share_percent": SHARE_PERCENT,
                    "margin_ms": 5,
                    "min_samples": 30,
                },
            )
            assert started.status_code == 201, started.text
            started_at = time.monotonic()
            canary = started.json()
            states: list[dict] = []

            def ended() -> bool:
                states.append(api.get(f"/policy-experiments/{canary['id']}/").json())
                return states[-1]["status"] != "running"

            # The stated bound is the wait's upper limit (generous: it took ~1.5 s on the dev VM);
            # the time it took is printed, not asserted.
            wait_until(ended, ROLLBACK_WITHIN_S, interval_s=0.2, what="the canary's automatic rollback")
            rollback_s = time.monotonic() - started_at
            ended_version = states[-1]["ended_version"]
            # Traffic after the rollback, once the gateway runs the version without the canary.
            wait_until(
                lambda: sum(version >= ended_version for version in answers) >= 40,
                20,
                what="traffic on the version after the rollback",
            )
            stop.set()
            answered = sum((loop.result() for loop in loops), Counter())

        shown = api.get(f"/policy-experiments/{canary['id']}/").json()
        versions = [v["note"] for v in api.get("/policy-versions/").json()["results"]]

    sys.stdout.write(f"canary rollback after {rollback_s:.1f} s: {shown['end_note']}\n")
    assert shown["status"] == "rolled_back", processes.logs()
    assert answered == Counter({200: sum(answered.values())}), answered
    assert any(note.startswith(f"canary #{canary['id']}") and "rolled back" in note for note in versions), (
        versions
    )

    # What the gateway logged: the canary served at most its share of the traffic while it ran.
    # The gateway writes its request log in the background, in batches: the last answers' records
    # reach the stream a moment after the answers themselves.
    def logged() -> list[RequestRecord]:
        client = redis.Redis.from_url(redis_url)
        try:
            return [
                decode(fields[REQUEST_STREAM_FIELD.encode()], RequestRecord)
                for _, fields in client.xrange(redis_keys.request_stream)
            ]
        finally:
            client.close()

    def on_version_after(records: list[RequestRecord]) -> list[RequestRecord]:
        return [r for r in records if r.policy_version is not None and r.policy_version >= ended_version]

    wait_until(
        lambda: len(on_version_after(logged())) >= 40,
        10,
        interval_s=0.2,
        what="the log of the answers after the rollback",
    )
    records = logged()
    during = [r for r in records if r.canary_id == canary["id"]]
    arms = Counter(r.arm for r in during)
    share = arms["canary"] / len(during)
    sys.stdout.write(f"canary share while it ran: {share:.3f} of {len(during)} requests ({dict(arms)})\n")
    n = len(during)
    assert share <= SHARE_PERCENT / 100 + 3 * (0.2 * 0.8 / n) ** 0.5, (share, n)
    assert {r.node_id for r in during if r.arm == "live"} == {node_ids["us-east-1"]}  # live stays home
    after = on_version_after(records)
    assert len(after) >= 40 and all(r.canary_id is None for r in after)  # the gateway dropped it
