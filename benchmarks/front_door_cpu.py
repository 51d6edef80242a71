"""CPU the front door costs one request, measured in-process (no network, no load generator noise).

    python benchmarks/front_door_cpu.py        # from the repo root; a few seconds

Times what the request path (``routing/proxy/handler.py``) runs per request when ``GORGO_AUTH=on`` and the key has request and
token limits: the header scan that also picks up the key, ``FrontDoor.authenticate`` (sha256 of the
secret, key-set lookup, expiry), ``admit`` (scope, concurrency, the rate limiter served from its
lease) and ``done`` (slot, settlement bookkeeping, per-key metrics), against the header scan alone.
The limiter talks to the real Redis at ``REDIS_URL`` for its leases. The end-to-end comparison is
``gorgo+frontdoor`` in benchmarks/gateway_overhead.py; this isolates the front door's own share
from the noise of a shared machine. Writes benchmarks/results/front_door_cpu.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

from redis.asyncio import Redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from routing.contract import ClientKeySpec, RedisKeys  # noqa: E402
from routing.frontdoor.concurrency import ConcurrencyLimiter  # noqa: E402
from routing.frontdoor.front_door import FrontDoor  # noqa: E402
from routing.frontdoor.keystore import KeyStore, secret_hash  # noqa: E402
from routing.frontdoor.ratelimit import RateLimiter, make_limiter_redis  # noqa: E402
from routing.http.headers import scan_request_headers  # noqa: E402
from routing.http.usage import Usage  # noqa: E402
from routing.observability.exporter import GatewayMetrics  # noqa: E402

SECRET = "gorgo-sk-bench-0123456789abcdefghijklmnopqrstuvwxyz"
ROUNDS = 7
PER_ROUND = 20_000


def make_front_door() -> tuple[FrontDoor, Redis, RedisKeys, list[tuple[bytes, bytes]], Usage]:
    """A front door with one key that has request and token limits, the limiter on the real Redis,
    and a request's headers presenting that key (shared with benchmarks/hotpath.py)."""
    redis = make_limiter_redis(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"), 0.25)
    keys = RedisKeys(prefix=f"gorgobench-{uuid.uuid4().hex[:12]}")
    store = KeyStore(redis, keys)
    key = ClientKeySpec(
        id="bench",
        secret_sha256=secret_hash(SECRET),
        owner="bench",
        requests_per_min=1_000_000_000,
        tokens_per_min=1_000_000_000_000,
    )
    store.by_hash = {key.secret_sha256: key}
    door = FrontDoor(
        "bench", store, RateLimiter(redis, keys), ConcurrencyLimiter(redis, keys, "bench"), GatewayMetrics()
    )
    headers = [
        (b"host", b"127.0.0.1:9001"),
        (b"content-type", b"application/json"),
        (b"authorization", b"Bearer " + SECRET.encode()),
        (b"content-length", b"120"),
    ]
    return door, redis, keys, headers, Usage(prompt_tokens=12, completion_tokens=4)


async def measure() -> dict[str, float]:
    door, redis, keys, headers, usage = make_front_door()
    with_door, without = [], []
    try:
        for _ in range(ROUNDS):
            start = time.perf_counter()
            for _ in range(PER_ROUND):
                found = scan_request_headers(headers, None, keep_credentials=False)
                client_key = door.authenticate(found)
                grant = await door.admit(client_key, "m", 12)
                door.done(client_key, grant, usage, 200)
            with_door.append((time.perf_counter() - start) / PER_ROUND * 1e6)
            start = time.perf_counter()
            for _ in range(PER_ROUND):
                scan_request_headers(headers, None)
            without.append((time.perf_counter() - start) / PER_ROUND * 1e6)
    finally:
        await redis.delete(keys.rate_limit("bench"))
        await redis.aclose()
    door_us = statistics.median(with_door)
    scan_us = statistics.median(without)
    return {
        "front_door_us_per_request": round(door_us - scan_us, 2),
        "header_scan_with_front_door_us": round(door_us, 2),
        "header_scan_alone_us": round(scan_us, 2),
    }


def main() -> int:
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()  # --help, and a clear error for anything else
    figures = asyncio.run(measure())
    report = {
        "generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "method": f"median of {ROUNDS} rounds of {PER_ROUND} requests, in-process, lease from real Redis",
        **figures,
    }
    out = ROOT / "benchmarks" / "results" / "front_door_cpu.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
