"""What a key's shared limits add to time to first token when Redis is a WAN round trip away.

    python benchmarks/shared_limits_wan.py           # from the repo root; about 40 s
    python benchmarks/shared_limits_wan.py --rtts 0,60,235 --requests 400 --out var/slw

Issue 24, item 2: a key with ``max_concurrent`` cost one Redis Lua call per request, so with Redis
in another region every such request waited a full round trip before it was routed. This runs the
front door (``FrontDoor.admit`` / ``done``, the only place a request waits on shared limits) of two
gateways against the real Redis at ``REDIS_URL`` reached through ``simulator/tcp_delay.py`` at each
round trip of ``--rtts`` (0 and 120 ms), for one key with ``max_concurrent`` and request and token
limits. Each gateway runs a closed loop of ``CLIENTS`` clients, each request held open
``SERVICE_S`` (the node's work, emulated), ``--requests`` per gateway and round trip, every round
trip bounded by ``TIME_LIMIT_S``. The added TTFT of a request is how long ``admit`` took. Redis
calls are counted at the client (commands sent, renewals and settlements included).

Writes ``--out`` .json and .md (benchmarks/results/shared_limits_wan). The measurement of issue
24's change, with the limiters before it loaded from git beside the new ones, is kept in
benchmarks/results/shared_limits_wan_issue24.md; the compiled front door accepts only the limiter
classes built with it, so old limiters can no longer be loaded into it.
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
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from redis.asyncio import Redis  # noqa: E402
from redis.asyncio.retry import Retry  # noqa: E402
from redis.backoff import NoBackoff  # noqa: E402

from routing.contract import ClientKeySpec, RedisKeys  # noqa: E402
from routing.frontdoor.concurrency import ConcurrencyLimiter  # noqa: E402
from routing.frontdoor.front_door import FrontDoor  # noqa: E402
from routing.frontdoor.keystore import KeyStore, secret_hash  # noqa: E402
from routing.frontdoor.ratelimit import RateLimiter  # noqa: E402
from routing.http.usage import Usage  # noqa: E402
from routing.observability.exporter import GatewayMetrics  # noqa: E402
from simulator.tcp_delay import TcpDelayProxy  # noqa: E402

RTTS_MS = (0.0, 120.0)
GATEWAYS = 2
CLIENTS = 8  # per gateway, each one request at a time
REQUESTS = 800  # per gateway and round trip (--requests)
SERVICE_S = 0.05
TIME_LIMIT_S = 60.0
MAX_CONCURRENT = 24  # above the 16 the two gateways keep open: admissions are not refused
TIMEOUT_S = 1.0  # the limiter client's socket timeouts (GORGO_RATELIMIT_REDIS_TIMEOUT_S)
SECRET = "gorgo-sk-wan-0123456789abcdefghijklmnopqrstuvwxyz"
OUT = ROOT / "benchmarks" / "results" / "shared_limits_wan"


class CountingRedis(Redis):
    """The limiters' client; counts the commands it sends."""

    commands = 0

    async def execute_command(self, *args, **options):
        self.commands += 1
        return await super().execute_command(*args, **options)


async def gateway_loop(
    door: FrontDoor, key: ClientKeySpec, samples: list[tuple[float, float]], refused: list[int], requests: int
) -> None:
    usage = Usage(prompt_tokens=100, completion_tokens=20)
    deadline = time.monotonic() + TIME_LIMIT_S
    per_client = requests // CLIENTS

    async def client() -> None:
        for _ in range(per_client):
            if time.monotonic() > deadline:
                return
            start = time.perf_counter()
            try:
                grant = await door.admit(key, "m", 100)
            except Exception:
                refused[0] += 1
                continue
            samples.append((start, (time.perf_counter() - start) * 1000))
            await asyncio.sleep(SERVICE_S)  # the node's work: the slot is held meanwhile
            door.done(key, grant, usage, 200)

    await asyncio.gather(*(client() for _ in range(CLIENTS)))


async def run_one(rtt_ms: float, redis_url: str, requests: int) -> dict[str, object]:
    parsed = urlparse(redis_url)
    proxy = TcpDelayProxy(parsed.hostname or "127.0.0.1", parsed.port or 6379, rtt_ms=rtt_ms)
    port = await proxy.start()
    url = f"redis://127.0.0.1:{port}{parsed.path or '/0'}"
    keys = RedisKeys(prefix=f"gorgobench-{uuid.uuid4().hex[:12]}")
    key = ClientKeySpec(
        id="wan",
        secret_sha256=secret_hash(SECRET),
        owner="bench",
        max_concurrent=MAX_CONCURRENT,
        requests_per_min=60_000,
        tokens_per_min=60_000_000,
    )
    clients = [
        CountingRedis.from_url(
            url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S, retry=Retry(NoBackoff(), 0)
        )
        for _ in range(GATEWAYS)
    ]
    doors = []
    for index, client in enumerate(clients):
        store = KeyStore(client, keys)
        store.by_hash = {key.secret_sha256: key}
        limiter = RateLimiter(client, keys)
        concurrency = ConcurrencyLimiter(client, keys, f"gw-{index}")
        limiter.start()
        concurrency.start()
        doors.append(FrontDoor("bench", store, limiter, concurrency, GatewayMetrics()))
    # Connections and scripts warm (and, after, the first lease taken) before measuring.
    for door in doors:
        await door.admit(key, "m", 100)
        door.done(key, None, None, 200)
        door.concurrency.release(key)
    commands_before = sum(client.commands for client in clients)
    samples: list[tuple[float, float]] = []  # (perf_counter at admit, added ms)
    refused = [0]
    start = time.monotonic()
    perf_start = time.perf_counter()
    try:
        await asyncio.gather(*(gateway_loop(door, key, samples, refused, requests) for door in doors))
        elapsed_s = time.monotonic() - start
        commands = sum(client.commands for client in clients) - commands_before
        fallbacks = sum(door.concurrency.fallbacks + door.limiter.fallbacks for door in doors)
    finally:
        for door in doors:
            await door.concurrency.close()
            await door.limiter.close()
        direct = Redis.from_url(redis_url)
        await direct.delete(keys.rate_limit(key.id), keys.concurrency(key.id))
        await direct.aclose()
        for client in clients:
            await client.aclose()
        await proxy.close()
    added_ms = sorted(value for _at, value in samples)
    count = len(added_ms)
    paid = sum(value >= rtt_ms * 0.9 for value in added_ms) if rtt_ms else 0
    # After the first second: the steady state (the first leases and the burst's ramp are over).
    steady = sorted(value for at, value in samples if at - perf_start >= 1.0)
    steady_paid = sum(value >= rtt_ms * 0.9 for value in steady) if rtt_ms else 0
    return {
        "shared_state_rtt_ms": rtt_ms,
        "requests": count,
        "refused": refused[0],
        "fallbacks": fallbacks,
        "added_ttft_ms": {
            "mean": round(statistics.fmean(added_ms), 3),
            "p50": round(added_ms[count // 2], 3),
            "p90": round(added_ms[int(count * 0.9)], 3),
            "p99": round(added_ms[min(count - 1, int(count * 0.99))], 3),
            "max": round(added_ms[-1], 3),
        },
        "requests_paying_a_round_trip": paid,
        "steady_state": {
            "requests": len(steady),
            "paying_a_round_trip": steady_paid,
            "added_ttft_ms_p99": round(steady[min(len(steady) - 1, int(len(steady) * 0.99))], 3)
            if steady
            else None,
            "added_ttft_ms_max": round(steady[-1], 3) if steady else None,
        },
        "redis_commands_per_request": round(commands / max(count, 1), 4),
        "elapsed_s": round(elapsed_s, 2),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rtts",
        default=",".join(f"{rtt:g}" for rtt in RTTS_MS),
        help="round trips to Redis in ms, comma-separated",
    )
    parser.add_argument("--requests", type=int, default=REQUESTS, help="requests per gateway and round trip")
    parser.add_argument("--out", type=Path, default=OUT, help="results path without suffix (.json and .md)")
    args = parser.parse_args(argv)
    try:
        args.rtts = [float(value) for value in args.rtts.split(",")]
    except ValueError:
        parser.error(f"--rtts: comma-separated milliseconds, got {args.rtts!r}")
    if any(rtt < 0 for rtt in args.rtts) or args.requests < CLIENTS:
        parser.error(f"--rtts must be >= 0 and --requests at least {CLIENTS} (one per client)")
    return args


async def main(args: argparse.Namespace) -> None:
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    if urlparse(redis_url).hostname not in ("127.0.0.1", "localhost"):
        raise SystemExit("REDIS_URL must be on loopback")
    rows = []
    for rtt_ms in args.rtts:
        row = await run_one(rtt_ms, redis_url, args.requests)
        print(json.dumps(row), flush=True)
        rows.append(row)
    meta = {
        "gateways": GATEWAYS,
        "clients_per_gateway": CLIENTS,
        "requests_per_gateway": args.requests,
        "service_s": SERVICE_S,
        "key": {"max_concurrent": MAX_CONCURRENT, "requests_per_min": 60_000, "tokens_per_min": 60_000_000},
        "limiter_redis_timeout_s": TIMEOUT_S,
        "note": "added TTFT = time in FrontDoor.admit; Redis on loopback behind simulator/tcp_delay.py",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "runs": rows}, indent=2) + "\n")
    lines = [
        "# Shared limits with Redis a WAN round trip away (issue 24, item 2)",
        "",
        "`python benchmarks/shared_limits_wan.py`: two gateways' front doors, one key with "
        f"`max_concurrent` {MAX_CONCURRENT}, 60,000 requests/min and 60M tokens/min, {CLIENTS} clients "
        f"per gateway each holding a request {SERVICE_S * 1000:.0f} ms, {args.requests} requests per gateway.",
        "Added TTFT = time a request waits in `FrontDoor.admit` (concurrency + rate limits).",
        "",
        "| shared-state RTT | added TTFT p50 | p90 | p99 | mean "
        "| requests paying a round trip | after the first second: paying / p99 "
        "| Redis commands / request |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ttft = row["added_ttft_ms"]
        steady = row["steady_state"]
        assert isinstance(ttft, dict) and isinstance(steady, dict)
        steady_p99 = "-" if steady["added_ttft_ms_p99"] is None else f"{steady['added_ttft_ms_p99']:.2f} ms"
        lines.append(
            f"| {row['shared_state_rtt_ms']:g} ms | {ttft['p50']:.2f} ms | "
            f"{ttft['p90']:.2f} ms | {ttft['p99']:.2f} ms | {ttft['mean']:.2f} ms | "
            f"{row['requests_paying_a_round_trip']} of {row['requests']} | "
            f"{steady['paying_a_round_trip']} of {steady['requests']} / {steady_p99} | "
            f"{row['redis_commands_per_request']} |"
        )
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
