"""What an idle gateway costs: CPU and wake-ups a second with no traffic, one and two workers.

    python benchmarks/gateway_idle.py                      # ~1 minute, bounded
    python benchmarks/gateway_idle.py --baseline ../old    # beside another checkout's gateway

A gateway with no traffic still runs its background loops (request log and prefix flushes, the
load exchange, probes, settles, refreshes; routing/background.py). On a VM a wake-up of an idle
process costs far more CPU than the loop's own work, so the figure that matters is how many times
a second the gateway wakes. Each target is ``python -m routing`` with the front door on, one key,
the ``gorgo`` policy over the three mock nodes of ``gateway_overhead.py`` and its request log on,
exactly as that benchmark starts it. The targets are all up together and measured in turns
(``--rounds`` rounds of ``--seconds``, order rotated each round); per target: CPU ms a second
(``/proc/<pid>/task/*/schedstat``: time on a CPU, every thread of every process of the group,
ns-precise) and wake-ups a second (the same file's count of runs on a CPU). Medians over rounds.

``--baseline PATH``: a checkout of another commit, run with this environment's Python from that
checkout (its own ``var/mypyc`` build if it has one, else pure Python: the report says which).
Writes benchmarks/results/gateway_idle.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from gateway_overhead import (  # this directory is on sys.path when run as a script
    ROOT,
    Target,
    _publish_bench_key,
    _publish_policy,
    _redis_cleanup,
    _start,
    start_mocks,
)

from simulator.harness import exit_on_sigterm, stop_process_groups, wait_until

_LISTENING = r"listening on http://127\.0\.0\.1:(\d+)"


def group_schedstat(pgid: int) -> tuple[float, int]:
    """(seconds on a CPU, runs on a CPU) summed over every thread of every process of group ``pgid``."""
    on_cpu_ns = runs = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                if int(stat.read().rsplit(")", 1)[1].split()[2]) != pgid:
                    continue
            for thread in os.listdir(f"/proc/{entry}/task"):
                with open(f"/proc/{entry}/task/{thread}/schedstat") as schedstat:
                    fields = schedstat.read().split()
                on_cpu_ns += int(fields[0])
                runs += int(fields[2])
        except (OSError, IndexError, ValueError):
            continue  # a process or thread that just ended
    return on_cpu_ns / 1e9, runs


def start_gateway(
    name: str, workers: int, checkout: Path, workdir: Path, redis_url: str, upstreams: list[str]
) -> tuple[Target, str]:
    prefix = f"gorgoidle-{uuid.uuid4().hex[:12]}"
    _publish_policy(redis_url, prefix, upstreams, "gorgo")
    _publish_bench_key(redis_url, prefix)
    env = {
        "REDIS_URL": redis_url,
        "GORGO_REDIS_PREFIX": prefix,
        "LOG_LEVEL": "info",
        "GORGO_AUTH": "on",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "",
    }
    target = _start(
        name.replace(" ", "-"),
        [sys.executable, "-m", "routing", "--port", "0", "--region", "bench", "--workers", str(workers)],
        workdir,
        env,
        port_pattern=_LISTENING,
        cwd=checkout,
    )
    wait_until(
        lambda: len(re.findall(_LISTENING, target.log_path.read_text(errors="replace"))) >= workers,
        30.0,
        what=f"{name}: {workers} workers listening",
    )
    return target, prefix


def commit_of(checkout: Path) -> str:
    """The checkout's commit (short hash; ``+changes`` when its tree differs from it)."""
    import subprocess

    def git(*argv: str) -> str:
        return subprocess.run(
            ["git", "-C", str(checkout), *argv], capture_output=True, text=True
        ).stdout.strip()

    return (git("rev-parse", "--short", "HEAD") or "unknown") + (
        "+changes" if git("status", "--porcelain") else ""
    )


def native_of(checkout: Path) -> str:
    """Whether that checkout's gateway runs compiled (a var/mypyc build of its sources) or pure."""
    import subprocess

    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import routing.native as n; print('compiled' if n.current_build() else 'pure')",
        ],
        cwd=checkout,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return probe.stdout.strip() or f"unknown ({probe.stderr.strip()[-200:]})"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5, help="rounds taken in turns (default 5)")
    parser.add_argument("--seconds", type=float, default=6.0, help="seconds measured per target per round")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds after start before measuring")
    parser.add_argument(
        "--baseline", type=Path, help="a checkout of another commit, measured beside this one"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gateway_idle")
    args = parser.parse_args()
    exit_on_sigterm()  # a kill stops what this started
    if not 1 <= args.rounds <= 50 or not 0.5 <= args.seconds <= 60:
        parser.error("--rounds 1..50 and --seconds 0.5..60 keep the run bounded")

    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    workdir = Path(tempfile.mkdtemp(prefix="gorgo-idle-"))
    checkouts = {"this": ROOT} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    builds = {label: native_of(path) for label, path in checkouts.items()}
    commits = {label: commit_of(path) for label, path in checkouts.items()}
    mocks = start_mocks(workdir)
    upstreams = [f"http://127.0.0.1:{mock.port}" for mock in mocks]
    targets: list[tuple[str, Target]] = []
    prefixes: list[str] = []
    started = time.time()
    try:
        for label, path in checkouts.items():
            for workers in (1, 2):
                name = f"{label} x{workers}"
                target, prefix = start_gateway(name, workers, path, workdir, redis_url, upstreams)
                targets.append((name, target))
                prefixes.append(prefix)
        time.sleep(args.settle)
        rounds: list[dict[str, dict[str, float]]] = []
        for index in range(args.rounds):
            shift = index % len(targets)
            figures: dict[str, dict[str, float]] = {}
            for name, target in targets[shift:] + targets[:shift]:
                cpu_before, runs_before = group_schedstat(target.process.pid)
                begun = time.monotonic()
                time.sleep(args.seconds)
                elapsed = time.monotonic() - begun
                cpu_after, runs_after = group_schedstat(target.process.pid)
                figures[name] = {
                    "cpu_ms_per_s": round((cpu_after - cpu_before) / elapsed * 1e3, 3),
                    "wakeups_per_s": round((runs_after - runs_before) / elapsed, 1),
                }
            rounds.append(figures)
            print(f"round {index + 1}/{args.rounds}: {json.dumps(figures)}", flush=True)
    finally:
        stop_process_groups([target.process for _, target in targets] + [mock.process for mock in mocks])
        for prefix in prefixes:
            _redis_cleanup(redis_url, prefix)

    summary = {
        name: {
            key: round(statistics.median(each[name][key] for each in rounds), 2)
            for key in ("cpu_ms_per_s", "wakeups_per_s")
        }
        for name, _ in targets
    }
    report = {
        "generated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        },
        "builds": builds,
        "commits": commits,
        "baseline": str(args.baseline) if args.baseline else None,
        "rounds": args.rounds,
        "seconds": args.seconds,
        "summary": summary,
        "per_round": rounds,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# Idle gateway",
        "",
        f"`python benchmarks/gateway_idle.py{' --baseline <checkout>' if args.baseline else ''}` on "
        f"{report['generated']}, {platform.platform()}, {os.cpu_count()} CPUs. No traffic; front door on, one key, "
        f"policy `gorgo` over 3 mock nodes, request log on. Medians over {args.rounds} rounds of {args.seconds:g} s "
        "taken in turns (all targets up together). CPU: time on a CPU of every thread of the gateway's "
        "processes; wake-ups: how often they were put on a CPU (/proc/*/task/*/schedstat).",
        "",
        "| target | commit | build | CPU ms a second | wake-ups a second |",
        "|---|---|---|---:|---:|",
    ]
    for name, figures in summary.items():
        label = name.split(" ")[0]
        lines.append(
            f"| {name} | {commits[label]} | {builds[label]} | {figures['cpu_ms_per_s']:g} | {figures['wakeups_per_s']:g} |"
        )
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
