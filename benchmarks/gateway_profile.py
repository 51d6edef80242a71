"""Where the gateway's CPU per request goes: py-spy samples of the process under wrk, by component.

    python benchmarks/gateway_profile.py [--auth off] [--seconds 12]     # needs py-spy and wrk

Starts three mock upstreams and ``python -m routing`` (front door on: one key with limits, the
``gorgo`` policy, request log on), warms it up, then runs ``wrk -c32`` while py-spy samples the
gateway (500 Hz, raw stacks, the process paused for each sample).

The table splits the gateway's /proc CPU per request (over the wrk run): system time is one row
(the kernel: ``send``, ``recv``, ``epoll``); user time is split by the share of py-spy's samples
in each component (by the innermost frame; native code shows as the Python line that called it).
Samples on a ``transport.write`` line are left out of that split: they are the ``send`` syscall,
where on a busy loopback the sender is mostly runnable, not running (the woken receiver preempts
it), so their sample time says little about CPU; they are listed as a share of samples only.
Prints a markdown table (docs/gateway.md, "Where the CPU goes").
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import gateway_overhead as bench  # this directory is on sys.path when run as a script

from simulator.harness import exit_on_sigterm

ROOT = Path(__file__).resolve().parent.parent
RATE_HZ = 500

# Innermost-frame rules, first match wins: (substring of the frame or of the stack, component).
LEAF_RULES = [
    ("_Connection.send (routing/http/upstream.py", "kernel: send to the node (syscall)"),
    ("ClientRequest.respond (routing/http/client_side.py", "kernel: send to the client (syscall)"),
    ("ClientRequest.write (routing/http/client_side.py", "kernel: send to the client (syscall)"),
    ("StreamWriter.writelines (asyncio/streams.py", "kernel: send to Redis (syscall)"),
    ("Runner.run (asyncio/runners.py", "event loop: uvloop (epoll, recv, callback dispatch)"),
]
STACK_RULES = [
    ("RequestLog", "request log (record, encode, batched XADD)"),
    ("GatewaySharing", "load/prefix exchange (background)"),
    ("PolicyStore", "policy store (background)"),
    ("NodeProber._loop", "node probes (background)"),
]
FILE_RULES = [
    ("routing/http/client_side.py", "client side: HTTP parse, limits, answers (routing/http/client_side.py)"),
    ("routing/http/server.py", "client side: HTTP parse, limits, answers (routing/http/client_side.py)"),
    ("routing/http/upstream.py", "upstream client (routing/http/upstream.py)"),
    ("httptools", "upstream client (routing/http/upstream.py)"),
    ("routing/frontdoor/auth", "front door: keys, limits, grants"),
    ("routing/frontdoor/front_door", "front door: keys, limits, grants"),
    ("routing/frontdoor/ratelimit", "front door: keys, limits, grants"),
    ("routing/frontdoor/keystore", "front door: keys, limits, grants"),
    ("routing/algorithms", "routing decision (algorithm, prefix index, view)"),
    ("routing/cache/approx_index", "routing decision (algorithm, prefix index, view)"),
    ("routing/frontdoor/admission", "admission + in-flight accounting"),
    ("routing/state/inflight", "admission + in-flight accounting"),
    ("redis/", "redis-py (limiter lease refills, load exchange, log flush)"),
    ("prometheus_client", "metrics"),
    ("routing/observability/exporter", "metrics"),
    ("routing/cache/prompt", "body parse (msgspec) + usage parse"),
    ("routing/http/usage", "body parse (msgspec) + usage parse"),
    ("routing/http/headers", "header scan (routing/http/headers.py)"),
    ("routing/resilience/node_probe", "hung-node watch timer"),
    ("routing/proxy/", "request path glue (routing/proxy/)"),
    ("routing/resilience/retry", "request path glue (routing/proxy/)"),
    ("routing/app", "request path glue (routing/proxy/)"),
    ("asyncio/", "asyncio: tasks, events, timeouts"),
    ("<string>", "dataclass/struct constructors"),
]


def component(frames: list[str]) -> str:
    leaf = frames[-1]
    for needle, name in LEAF_RULES:
        if needle in leaf:
            return name
    stack = ";".join(frames)
    for needle, name in STACK_RULES:
        if needle in stack:
            return name
    for needle, name in FILE_RULES:
        if needle in leaf:
            return name
    return "other"


def table(raw: Path, user_us: float, system_us: float) -> str:
    counts: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        counts[component(stack.split(";"))] += int(count)
        total += int(count)
    kernel = sum(count for name, count in counts.items() if name.startswith("kernel:"))
    user_samples = total - kernel
    lines = ["| component | share of samples | µs CPU / request |", "|---|---:|---:|"]
    lines.append(
        f"| kernel (system time: send, recv, epoll) | {kernel / total:.1%} (the send lines) | {system_us:.1f} |"
    )
    for name, count in counts.most_common():
        if not name.startswith("kernel:"):
            lines.append(f"| {name} | {count / total:.1%} | {count / user_samples * user_us:.1f} |")
    lines.append(f"| **total** (/proc user + system) | 100% | **{user_us + system_us:.1f}** |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--auth", choices=("on", "off"), default="on", help="the front door (default on)")
    parser.add_argument("--seconds", type=float, default=12.0, help="wrk and py-spy duration")
    parser.add_argument("--raw", type=Path, help="keep py-spy's raw stacks here")
    parser.add_argument(
        "--native",
        action="store_true",
        help="py-spy --native: C frames too, so the compiled modules (routing/native.py) show their "
        "own functions (the table's split then sees less: read the raw stacks)",
    )
    args = parser.parse_args()
    exit_on_sigterm()  # a kill stops what this started
    sys.path.insert(0, str(ROOT))
    py_spy = Path(sys.executable).parent / "py-spy"
    workdir = Path(tempfile.mkdtemp(prefix="gorgo-profile-"))
    redis_url = bench.os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    mocks = bench.start_mocks(workdir)
    prefix = f"gorgoprof-{uuid.uuid4().hex[:12]}"
    bench._publish_policy(redis_url, prefix, [f"http://127.0.0.1:{m.port}" for m in mocks], "gorgo")
    bench._publish_bench_key(redis_url, prefix)
    gateway = bench._start(
        "gateway",
        [sys.executable, "-m", "routing", "--port", "0", "--region", "bench"],
        workdir,
        {"REDIS_URL": redis_url, "GORGO_REDIS_PREFIX": prefix, "LOG_LEVEL": "info", "GORGO_AUTH": args.auth},
        port_pattern=r"listening on http://127\.0\.0\.1:(\d+)",
    )
    auth = bench.BENCH_SECRET if args.auth == "on" else ""
    raw = args.raw or workdir / "stacks.txt"
    try:
        bench.latency_c1(gateway.port, 1000, 100, auth=auth)
        duration = str(int(args.seconds) + 1)
        argv = [str(py_spy), "record", "-p", str(gateway.process.pid), "-r", str(RATE_HZ), "-d", duration]
        if args.native:
            argv.append("--native")
        spy = subprocess.Popen(
            [*argv, "-f", "raw", "-o", str(raw)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(0.5)
        pid = gateway.process.pid
        cpu_before, sys_before = bench.group_cpu_s(pid), bench.group_cpu_s(pid, "system")
        _, done, loadgen = bench.throughput_c32(gateway.port, args.seconds, auth=auth)
        cpu_s = bench.group_cpu_s(pid) - cpu_before
        sys_s = bench.group_cpu_s(pid, "system") - sys_before
        spy.wait(timeout=60)
    finally:
        gateway.stop()
        for mock in mocks:
            mock.stop()
        bench._redis_cleanup(redis_url, prefix)
    print(
        f"front door {args.auth}; {done} requests ({loadgen}); /proc: {cpu_s / done * 1e6:.1f} µs CPU per "
        f"request under py-spy, of it {sys_s / done * 1e6:.1f} system\n"
    )
    print(table(raw, (cpu_s - sys_s) / done * 1e6, sys_s / done * 1e6))
    return 0


if __name__ == "__main__":
    sys.exit(main())
