"""What a key's shared limits add to time to first token when Redis is a WAN round trip away.

    python benchmarks/shared_limits_wan.py           # from the repo root; about a minute

Issue 24, item 2: a key with ``max_concurrent`` cost one Redis Lua call per request, so with Redis
in another region every such request waited a full round trip before it was routed. This runs the
front door (``FrontDoor.admit`` / ``done``, the only place a request waits on shared limits) of two
gateways against the real Redis at ``REDIS_URL`` reached through ``simulator/tcp_delay.py`` at 0
and 120 ms round trip, for one key with ``max_concurrent`` and request and token limits, with the
limiters before issue 24 (``routing/frontdoor/concurrency.py`` and ``ratelimit.py`` at
``BEFORE_REF``, loaded from git), with only the concurrency limiter's slots leased, and after (rate
leases also refilled in the background). Each gateway runs a closed loop of ``CLIENTS`` clients, each request
held open ``SERVICE_S`` (the node's work, emulated), ``REQUESTS`` per gateway and configuration,
every configuration bounded by ``TIME_LIMIT_S``. The added TTFT of a request is how long ``admit``
took. Redis calls are counted at the client (commands sent, renewals and settlements included).

Writes benchmarks/results/shared_limits_wan.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import ModuleType
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from redis.asyncio import Redis  # noqa: E402
from redis.asyncio.retry import Retry  # noqa: E402
from redis.backoff import NoBackoff  # noqa: E402

from routing.contract import ClientKeySpec, RedisKeys  # noqa: E402
from routing.frontdoor import concurrency as concurrency_after  # noqa: E402
from routing.frontdoor import ratelimit as ratelimit_after  # noqa: E402
from routing.frontdoor.front_door import FrontDoor  # noqa: E402
from routing.frontdoor.keystore import KeyStore, secret_hash  # noqa: E402
from routing.http.usage import Usage  # noqa: E402
from routing.observability.exporter import GatewayMetrics  # noqa: E402
from simulator.tcp_delay import TcpDelayProxy  # noqa: E402

BEFORE_REF = "ded405d"  # the last commit with one Lua call per max_concurrent admission
RTTS_MS = (0.0, 120.0)
GATEWAYS = 2
CLIENTS = 8  # per gateway, each one request at a time
REQUESTS = 800  # per gateway and configuration
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


def module_at(ref: str, path: str) -> ModuleType | None:
    """``path`` as it was at ``ref``, loaded as a module; ``None`` where git history lacks it."""
    try:
        source = subprocess.run(
            ["git", "show", f"{ref}:{path}"], cwd=ROOT, check=True, capture_output=True, text=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        print(f"git has no {ref}:{path}: measuring the current limiters only", file=sys.stderr)
        return None
    name = Path(path).stem + "_before"
    spec = importlib.util.spec_from_loader(name, loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    exec(compile(source, f"{name}.py", "exec"), module.__dict__)
    return module


async def gateway_loop(
    door: FrontDoor, key: ClientKeySpec, samples: list[tuple[float, float]], refused: list[int]
) -> None:
    usage = Usage(prompt_tokens=100, completion_tokens=20)
    deadline = time.monotonic() + TIME_LIMIT_S
    per_client = REQUESTS // CLIENTS

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


async def run_one(
    modules: tuple[ModuleType, ModuleType], label: str, rtt_ms: float, redis_url: str
) -> dict[str, object]:
    concurrency_module, ratelimit_module = modules
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
        limiter = ratelimit_module.RateLimiter(client, keys)
        concurrency = concurrency_module.ConcurrencyLimiter(client, keys, f"gw-{index}")
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
        await asyncio.gather(*(gateway_loop(door, key, samples, refused) for door in doors))
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
        "limiter": label,
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


async def main() -> None:
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()  # --help, and a clear error for anything else
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    if urlparse(redis_url).hostname not in ("127.0.0.1", "localhost"):
        raise SystemExit("REDIS_URL must be on loopback")
    concurrency_before = module_at(BEFORE_REF, "routing/frontdoor/concurrency.py")
    ratelimit_before = module_at(BEFORE_REF, "routing/frontdoor/ratelimit.py")
    variants: list[tuple[str, tuple[ModuleType, ModuleType]]] = []
    if concurrency_before and ratelimit_before:
        variants.append(("before", (concurrency_before, ratelimit_before)))
        # Leased slots with the rate limits' leases refilled only when a request finds them empty.
        variants.append(
            ("slots leased, rate leases refilled on demand", (concurrency_after, ratelimit_before))
        )
    variants.append(("after", (concurrency_after, ratelimit_after)))
    rows = []
    for rtt_ms in RTTS_MS:
        for label, modules in variants:
            row = await run_one(modules, label, rtt_ms, redis_url)
            print(json.dumps(row), flush=True)
            rows.append(row)
    meta = {
        "before_ref": BEFORE_REF,
        "gateways": GATEWAYS,
        "clients_per_gateway": CLIENTS,
        "requests_per_gateway": REQUESTS,
        "service_s": SERVICE_S,
        "key": {"max_concurrent": MAX_CONCURRENT, "requests_per_min": 60_000, "tokens_per_min": 60_000_000},
        "limiter_redis_timeout_s": TIMEOUT_S,
        "note": "added TTFT = time in FrontDoor.admit; Redis on loopback behind simulator/tcp_delay.py",
    }
    OUT.with_suffix(".json").write_text(json.dumps({"meta": meta, "runs": rows}, indent=2) + "\n")
    lines = [
        "# Shared limits with Redis a WAN round trip away (issue 24, item 2)",
        "",
        "`python benchmarks/shared_limits_wan.py`: two gateways' front doors, one key with "
        f"`max_concurrent` {MAX_CONCURRENT}, 60,000 requests/min and 60M tokens/min, {CLIENTS} clients "
        f"per gateway each holding a request {SERVICE_S * 1000:.0f} ms, {REQUESTS} requests per gateway.",
        "Added TTFT = time a request waits in `FrontDoor.admit` (concurrency + rate limits).",
        "",
        "| shared-state RTT | limiters | added TTFT p50 | p90 | p99 | mean "
        "| requests paying a round trip | after the first second: paying / p99 "
        "| Redis commands / request |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ttft = row["added_ttft_ms"]
        steady = row["steady_state"]
        assert isinstance(ttft, dict) and isinstance(steady, dict)
        lines.append(
            f"| {row['shared_state_rtt_ms']:.0f} ms | {row['limiter']} | {ttft['p50']:.2f} ms | "
            f"{ttft['p90']:.2f} ms | {ttft['p99']:.2f} ms | {ttft['mean']:.2f} ms | "
            f"{row['requests_paying_a_round_trip']} of {row['requests']} | "
            f"{steady['paying_a_round_trip']} of {steady['requests']} / {steady['added_ttft_ms_p99']:.2f} ms | "
            f"{row['redis_commands_per_request']} |"
        )
    OUT.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
