"""System calls per request of the gateway and of the Rust vllm-router, under the same load.

    python benchmarks/gateway_syscalls.py [--variant this=.] [--variant base=/work/main] [--router]
        [--seconds 5] [--json out.json]

Kernel time is a fifth to a third of a proxy's CPU per request, and most of it is the system calls
the proxy makes: a proxy that reads, writes or polls more often per request than it must pays for
it in time no instruction count shows (``gateway_instructions.py`` counts user space only). Each
target (``python -m routing`` with the front door on: one client key with limits, the ``gorgo``
policy over three mock nodes, request log on; or the router, round robin over the same nodes) is
warmed up, then ``strace -f -c`` is attached to its processes while ``wrk -t1 -c32`` runs, and the
calls of each kind are divided by the requests wrk completed. strace slows the traced process
(every call stops it), so only the counts mean anything here, not the rates. Needs strace and wrk.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import gateway_instructions as instructions  # this directory is on sys.path when run as a script
import gateway_overhead as bench

from simulator.harness import exit_on_sigterm

LISTENING = instructions.LISTENING


def _count(pids: list[int], port: int, seconds: float, workdir: Path, auth: str) -> dict:
    """strace -c over ``pids`` while wrk runs: calls per request, by system call."""
    out = workdir / f"strace-{uuid.uuid4().hex[:8]}.txt"
    argv = ["strace", "-f", "-c", "-o", str(out)]
    for pid in pids:
        argv += ["-p", str(pid)]
    tracer = subprocess.Popen(argv, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.0)  # attached to every thread
        script = bench.wrk_script(workdir / f"post-{uuid.uuid4().hex[:6]}.lua", auth)
        _, requests = bench.run_wrk(port, seconds, script)
    finally:
        tracer.send_signal(signal.SIGINT)
        tracer.wait(timeout=30)
    calls: dict[str, int] = {}
    for line in out.read_text().splitlines():
        # % time  seconds  usecs/call  calls  [errors]  syscall
        fields = line.split()
        if len(fields) >= 5 and fields[0][0].isdigit() and fields[-1] != "total":
            calls[fields[-1]] = int(fields[3])
    return {
        "requests": requests,
        "calls_per_request": {name: count / requests for name, count in sorted(calls.items())},
        "total_per_request": sum(calls.values()) / requests,
    }


def measure_gateway(
    name: str, checkout: Path, mocks: list, workdir: Path, redis_url: str, seconds: float
) -> dict:
    prefix = f"gorgosys-{uuid.uuid4().hex[:12]}"
    bench._publish_policy(redis_url, prefix, [f"http://127.0.0.1:{m.port}" for m in mocks], "gorgo")
    bench._publish_bench_key(redis_url, prefix)
    env = {"REDIS_URL": redis_url, "GORGO_REDIS_PREFIX": prefix, "LOG_LEVEL": "info", "GORGO_AUTH": "on"}
    argv = [str(checkout / ".venv" / "bin" / "python"), "-m", "routing", "--port", "0", "--region", "bench"]
    gateway = bench._start(f"gateway-{name}", argv, workdir, env, port_pattern=LISTENING, cwd=checkout)
    try:
        bench.latency_c1(gateway.port, 200, 100, auth=bench.BENCH_SECRET)
        row = _count(
            instructions._group_pids(gateway.process.pid),
            gateway.port,
            seconds,
            workdir,
            bench.BENCH_SECRET,
        )
    finally:
        gateway.stop()
        bench._redis_cleanup(redis_url, prefix)
    return {"name": name, "checkout": str(checkout), **row}


def measure_router(router: str, mocks: list, workdir: Path, seconds: float) -> dict:
    port = bench.free_port()
    argv = [router, "--worker-urls", *(f"http://127.0.0.1:{m.port}" for m in mocks)]
    argv += ["--policy", "round_robin", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    target = bench._start("vllm-router", argv, workdir, port=port)
    try:
        bench.latency_c1(port, 200, 100)
        row = _count(instructions._group_pids(target.process.pid), port, seconds, workdir, "")
    finally:
        target.stop()
    return {"name": "vllm-router", "checkout": router, **row}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variant", action="append", default=[], help="name=checkout (with its .venv)")
    parser.add_argument(
        "--router", action="store_true", help="also the Rust vllm-router (from a variant's .venv)"
    )
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    exit_on_sigterm()  # a kill stops what this started
    for tool in ("strace", "wrk"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is needed")
    variants = []
    for spec in args.variant or ["this=."]:
        name, _, checkout = spec.partition("=")
        variants.append((name, Path(checkout or ".").resolve()))
    # the first variant's checkout that has it (checked before anything runs)
    router = bench.router_in([checkout for _, checkout in variants]) if args.router else None
    redis_url = bench.os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    workdir = Path(tempfile.mkdtemp(prefix="gorgo-syscalls-"))
    mocks = bench.start_mocks(workdir)
    results = []
    try:
        for name, checkout in variants:
            results.append(measure_gateway(name, checkout, mocks, workdir, redis_url, args.seconds))
        if router is not None:
            results.append(measure_router(str(router), mocks, workdir, args.seconds))
    finally:
        for mock in mocks:
            mock.stop()
    names = sorted({call for row in results for call in row["calls_per_request"]})
    print("system calls per request: " + " | ".join(f"{row['name']} ({row['requests']})" for row in results))
    for call in names:
        values = [row["calls_per_request"].get(call, 0.0) for row in results]
        if max(values) >= 0.005:
            print(" | ".join(f"{value:7.3f}" for value in values) + f"  {call}")
    print(" | ".join(f"{row['total_per_request']:7.3f}" for row in results) + "  total")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
