"""Shared state over the emulated WAN for the routing benchmark (issue 24, item 2).

``benchmarks/routing_quality.py --shared-state loopback,wan`` runs every gateway policy twice: with
Redis on loopback (every gateway sees the others' load and prefixes at once, as before) and with
Redis in one region (``home_region``) reached from every other region's gateways through a TCP
delay proxy (``simulator/tcp_delay.py``) at that region's round trip to it from the topology (0 for
the home region: its gateways use Redis directly). The benchmark's own writes (the policy, the RTT
table, health) go to Redis directly: they stand for the control plane, which lives beside Redis.

With ``--front-door`` every gateway run also has the front door on: one client key with request,
token and ``max_concurrent`` limits (none of them reached), so that what a far Redis adds to the
request path (``RequestRecord.gateway_ms``: time in the gateway before the request leaves for the
node) is measured with every shared limit the key has.

Where a replica would go: a gateway names one Redis endpoint (``REDIS_URL``) for reads and writes
(it writes leases, load reports, prefix updates and the request log), so a per-region read
replica (``redis-server --replicaof``) would need a read URL the gateway does not have; this
emulates the deployment docs/deployment.md describes (one primary, in the home region).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from routing_quality_report import REGIONAL, RunFigures, over_seeds, spread

from routing.contract import SCHEMA_VERSION, ClientKeySet, ClientKeySpec, RedisKeys
from routing.frontdoor.keystore import secret_hash
from routing.writer import write
from simulator.harness import stop_process_group, wait_until
from simulator.topology import Topology

SHARED_STATES = ("loopback", "wan")
WAN_SUFFIX = "@wan-redis"  # the scenario name of a run with Redis over the emulated WAN
DEFAULT_LIMITER_TIMEOUT_S = 0.25  # GatewayConfig.ratelimit_redis_timeout_s
BENCH_SECRET = "gorgo-sk-routing-wan-0123456789abcdefghijklmnopqrstuv"
# Limits that shape nothing here (a run sends < 100 requests/s, a few dozen open at once) but
# that every request is checked against: leases, slots and their renewals all run.
BENCH_KEY = ClientKeySpec(
    id="bench-wan",
    secret_sha256=secret_hash(BENCH_SECRET),
    owner="bench",
    requests_per_min=600_000,
    tokens_per_min=10_000_000_000,
    max_concurrent=2_000,
)


def home_region(topology: Topology, client_shares: Mapping[str, float] | None) -> str:
    """Where Redis lives: the region with the most clients (their gateways then pay no round trip).

    On a tie (an even client mix), the first region of the topology: the control plane's region
    in docs/deployment.md's layout (us-east on the default topology).
    """
    regions = [r.slug for r in topology.regions]
    if not client_shares:
        return regions[0]
    return max(regions, key=lambda slug: (client_shares.get(slug, 0.0), -regions.index(slug)))


def state_rtts_ms(topology: Topology, home: str) -> dict[str, float]:
    """Each region's round trip to Redis (0 in the home region)."""
    return {r.slug: 0.0 if r.slug == home else topology.rtt_ms(r.slug, home) for r in topology.regions}


def limiter_timeout_s(rtt_ms: float) -> float:
    """``GORGO_RATELIMIT_REDIS_TIMEOUT_S`` for a gateway ``rtt_ms`` from Redis: twice the round
    trip, at least the default (docs/deployment.md)."""
    return max(DEFAULT_LIMITER_TIMEOUT_S, round(2 * rtt_ms / 1000, 3))


@dataclass
class WanRedis:
    """The delay proxies of one run (one process) and the Redis URL each region's gateways use."""

    popen: subprocess.Popen[bytes] | None
    urls: dict[str, str]
    rtts_ms: dict[str, float]

    def gateway_env(self) -> dict[str, dict[str, str]]:
        """Each region's gateway settings: its Redis URL, and limiter timeouts above its round trip
        (the 0.25 s default timed out at 235 ms: the limits fell back to per-gateway counts)."""
        return {
            region: {
                "REDIS_URL": url,
                "GORGO_RATELIMIT_REDIS_TIMEOUT_S": str(limiter_timeout_s(self.rtts_ms[region])),
            }
            for region, url in self.urls.items()
        }

    def stop(self) -> None:
        if self.popen is not None:
            stop_process_group(self.popen)


def start_wan_redis(redis_url: str, rtts_ms: dict[str, float], workdir: Path, root: Path) -> WanRedis:
    """One delay proxy per region away from Redis, as one ``python -m simulator.tcp_delay``."""
    parts = urlsplit(redis_url)
    far = [region for region, rtt in rtts_ms.items() if rtt > 0]
    urls = dict.fromkeys(rtts_ms, redis_url)
    if not far:
        return WanRedis(None, urls, rtts_ms)
    argv = [
        sys.executable,
        "-m",
        "simulator.tcp_delay",
        "--upstream",
        f"{parts.hostname}:{parts.port or 6379}",
    ]
    for region in far:
        argv += ["--rtt-ms", str(rtts_ms[region])]
    log_path = workdir / "tcp-delay.log"
    with log_path.open("wb") as log_file:
        popen = subprocess.Popen(
            argv, cwd=root, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )

    def ports() -> list[int] | None:
        for line in log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                return json.loads(line)["ports"]
        return None

    found = wait_until(ports, 15.0, what="tcp delay proxies ready", process=popen)
    for region, port in zip(far, found, strict=True):
        host = f"127.0.0.1:{port}"
        netloc = f"{parts.netloc.rpartition('@')[0]}@{host}" if "@" in parts.netloc else host
        urls[region] = urlunsplit(parts._replace(netloc=netloc))
    return WanRedis(popen, urls, rtts_ms)


def publish_bench_key(client: redis.Redis, keys: RedisKeys) -> str:
    """The run's one client key, as the control plane writes it; returns the secret to send."""
    import time

    if not write(client, keys, ClientKeySet(SCHEMA_VERSION, 1, time.time(), (BENCH_KEY,))):
        raise RuntimeError(f"{keys.prefix} already holds a newer key set")
    return BENCH_SECRET


# ---- the report ---------------------------------------------------------------------------------


def _median(figures: list[RunFigures], pick: Any) -> float | None:
    found = over_seeds(figures, pick)
    return found.median if found is not None else None


def _gateway_ms(region: str, field: str) -> Any:
    def pick(f: RunFigures) -> float | None:
        by_region = (f.gateway or {}).get("gateway_ms_by_region") or {}
        return (by_region.get(region) or {}).get(field)

    return pick


def wan_summary(
    runs: Mapping[str, Mapping[str, list[RunFigures]]], rtts_by_scenario: Mapping[str, Mapping[str, float]]
) -> dict[str, Any]:
    """Per scenario: gorgo's advantage over the regional baseline with loopback and WAN Redis, and
    what the WAN added inside the gateways (``gateway_ms``), per region."""
    summary: dict[str, Any] = {}
    for scenario, rtts in rtts_by_scenario.items():
        loop, wan = runs.get(scenario, {}), runs.get(scenario + WAN_SUFFIX, {})
        if "gorgo" not in loop or "gorgo" not in wan:
            continue
        regional_name, regional = min(
            ((n, loop[n]) for n in REGIONAL if n in loop),
            key=lambda item: _median(item[1], lambda f: f.ttft_p50_ms) or float("inf"),
            default=(None, None),
        )
        row: dict[str, Any] = {"shared_state_rtt_ms": dict(rtts), "regional_baseline": regional_name}
        for label, pick in (("p50", lambda f: f.ttft_p50_ms), ("p99", lambda f: f.ttft_p99_ms)):
            g_loop, g_wan = _median(loop["gorgo"], pick), _median(wan["gorgo"], pick)
            base = _median(regional, pick) if regional else None
            entry = {"gorgo_loopback_ms": g_loop, "gorgo_wan_ms": g_wan, "regional_ms": base}
            if base is not None and g_loop is not None and g_wan is not None:
                entry["advantage_loopback_ms"] = base - g_loop
                entry["advantage_wan_ms"] = base - g_wan
                # A share of an advantage only where there was one with loopback Redis.
                if base > g_loop:
                    entry["advantage_surviving"] = (base - g_wan) / (base - g_loop)
            row[label] = entry
        by_region: dict[str, Any] = {}
        for region in rtts:
            by_region[region] = {
                "shared_state_rtt_ms": rtts[region],
                "ttft_p50_loopback_ms": _median(loop["gorgo"], _region_p50(region)),
                "ttft_p50_wan_ms": _median(wan["gorgo"], _region_p50(region)),
                "regional_p50_ms": _median(regional, _region_p50(region)) if regional else None,
                **{
                    f"gateway_ms_{field}_{state}": _median(figures, _gateway_ms(region, field))
                    for state, figures in (("loopback", loop["gorgo"]), ("wan", wan["gorgo"]))
                    for field in ("p50", "p99", "max")
                },
                "requests_over_40ms_in_gateway_wan": spread(
                    [_gateway_ms(region, "over_40ms")(f) for f in wan["gorgo"]]
                ).__dict__
                if any(_gateway_ms(region, "over_40ms")(f) is not None for f in wan["gorgo"])
                else None,
            }
        row["by_region"] = by_region
        summary[scenario] = row
    return summary


def _region_p50(region: str) -> Any:
    return lambda f: f.by_region[region].ttft_p50_ms if region in f.by_region else None


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f} ms"


def _ms2(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} ms"


def _count(found: Mapping[str, float] | None) -> str:
    if found is None:
        return "-"
    return f"{found['median']:.0f} ({found['low']:.0f}-{found['high']:.0f})"


def summary_markdown(summary: Mapping[str, Any], front_door: bool) -> list[str]:
    """The markdown section of ``wan_summary``."""
    lines = [
        "## Shared state over the emulated WAN",
        "",
        "Redis in one region (the one with the most clients; on a tie, the first: the control "
        "plane's); every other region's gateways reach it through `simulator/tcp_delay.py` at their "
        "round trip to that region. Advantage = regional baseline minus gorgo; surviving = the WAN "
        "run's advantage over the loopback run's. Medians over seeds."
        + (
            " Front door on in every gateway run: one key with requests/min, tokens/min and "
            "`max_concurrent` limits."
            if front_door
            else ""
        ),
        "",
        "| workload | | regional | gorgo, loopback Redis | gorgo, WAN Redis | advantage loopback | "
        "advantage WAN | surviving |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for scenario, row in summary.items():
        for label in ("p50", "p99"):
            entry = row.get(label) or {}
            surviving = entry.get("advantage_surviving")
            lines.append(
                f"| {scenario} | {label} | {_ms(entry.get('regional_ms'))} ({row['regional_baseline']}) "
                f"| {_ms(entry.get('gorgo_loopback_ms'))} | {_ms(entry.get('gorgo_wan_ms'))} "
                f"| {_ms(entry.get('advantage_loopback_ms'))} | {_ms(entry.get('advantage_wan_ms'))} "
                f"| {'-' if surviving is None else f'{surviving:.0%}'} |"
            )
    lines += [
        "",
        "Per region: the time a request spent in the gateway before it left for its node "
        "(`gateway_ms`: parsing, the front door, routing), loopback against WAN Redis, and the "
        "requests of the WAN run that spent 40 ms or more there (half the shortest link: what a Redis "
        "round trip on the request path would cost at least).",
        "",
        "| workload | region | RTT to Redis | clients' p50 loopback / WAN / regional | gateway_ms p50 "
        "loopback / WAN | p99 loopback / WAN | max loopback / WAN | requests >= 40 ms in the gateway (WAN) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for scenario, row in summary.items():
        for region, r in row["by_region"].items():
            paying = r.get("requests_over_40ms_in_gateway_wan")
            lines.append(
                f"| {scenario} | {region} | {r['shared_state_rtt_ms']:.0f} ms "
                f"| {_ms(r['ttft_p50_loopback_ms'])} / {_ms(r['ttft_p50_wan_ms'])} / {_ms(r['regional_p50_ms'])} "
                f"| {_ms2(r['gateway_ms_p50_loopback'])} / {_ms2(r['gateway_ms_p50_wan'])} "
                f"| {_ms2(r['gateway_ms_p99_loopback'])} / {_ms2(r['gateway_ms_p99_wan'])} "
                f"| {_ms2(r['gateway_ms_max_loopback'])} / {_ms2(r['gateway_ms_max_wan'])} "
                f"| {_count(paying)} |"
            )
    return lines
