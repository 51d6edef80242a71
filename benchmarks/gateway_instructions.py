"""Instructions per request of the gateway under callgrind: a comparison no busy machine can blur.

    python benchmarks/gateway_instructions.py --variant main=/work/main --variant this=.
        [--variant pure=.:pure] [--variant x2=.:compiled:2] [--seconds 8] [--top 40]
    python benchmarks/gateway_instructions.py --algorithm least_load \
        --variant off=. --variant shadow=.:compiled:1:gorgo [--shadow-params '{"w_rtt": 0}'] --top 40

CPU time per request on a shared 2-core host moves by ±15-30 % from round to round (other work,
frequency, caches, and how many requests the loop finds per turn), so a 5 % change needs many
rounds to show. Instructions retired in user space do not depend on the neighbours: each variant
runs ``python -m routing`` (front door on: one key with limits, the ``gorgo`` policy over three
mock nodes, request log on) under ``valgrind --tool=callgrind`` with instrumentation off until
the warm-up is done, then counts every instruction of the gateway process(es) while ``wrk -c32``
runs, and divides by the requests wrk completed. Two runs of the same gateway agree within ~1 %.

What it does not see: the kernel (system time is ~20 % of the gateway's CPU), and cycles per
instruction (a cache-missing instruction counts as one). Under valgrind the gateway serves ~50x
fewer requests per second, so its timed background loops (load exchange, log flush, limiter
leases) weigh ~50x more per request than in production: read differences in the request path
(``--top`` prints the compiled functions' inclusive counts per request, side by side).

``--router`` also counts the Rust vllm-router (round robin over the same mock nodes, the same
``wrk -c32`` load without a client key; ``pip install -e '.[peers]'`` in a variant's
checkout): the yardstick of issue 25, counted the same way.

A variant is ``name=checkout[:pure|:compiled[:workers[:shadow]]]``: ``shadow`` names a shadow
policy's algorithm run beside the live one (issue 23; its parameters from ``--shadow-params``);
``--algorithm`` sets the live policy of every variant. The checkout needs its own ``.venv`` (and, for
``compiled``, its mypyc build: ``make native``). Needs valgrind and wrk.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import gateway_overhead as bench  # this directory is on sys.path when run as a script

ROOT = Path(__file__).resolve().parent.parent
LISTENING = r"listening on http://127\.0\.0\.1:(\d+)"


def _parse_variant(spec: str) -> tuple[str, Path, bool, int, str | None]:
    name, _, rest = spec.partition("=")
    parts = rest.split(":")
    checkout = Path(parts[0] or ".").resolve()
    pure = len(parts) > 1 and parts[1] == "pure"
    workers = int(parts[2]) if len(parts) > 2 and parts[2] else 1
    shadow = parts[3] if len(parts) > 3 and parts[3] else None
    if not name or not (checkout / ".venv" / "bin" / "python").exists():
        raise SystemExit(
            f"--variant {spec!r}: want name=checkout[:pure|:compiled[:workers[:shadow]]], with checkout/.venv"
        )
    return name, checkout, pure, workers, shadow


def _inclusive(out_files: list[Path]) -> collections.Counter[str]:
    """Inclusive instructions per function (compiled modules' C functions by name), all processes."""
    counts: collections.Counter[str] = collections.Counter()
    for path in out_files:
        text = subprocess.run(
            ["callgrind_annotate", "--inclusive=yes", "--threshold=100", str(path)],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        # One function may be listed under several files (code inlined from headers, a build
        # directory's relative and absolute paths), each entry inclusive: summing them counted
        # some functions twice. Its largest entry per process.
        largest: dict[str, int] = {}
        for line in text.splitlines():
            match = re.match(r"\s*([\d,]+) \([^)]*\)\s+\S*?:?(CPy(?:Def|Py)_\S+)", line)
            if match:
                name, count = match.group(2), int(match.group(1).replace(",", ""))
                largest[name] = max(count, largest.get(name, 0))
        counts.update(largest)
    return counts


def measure(
    name: str,
    checkout: Path,
    pure: bool,
    workers: int,
    seconds: float,
    mocks: list,
    workdir: Path,
    redis_url: str,
    algorithm: str = "gorgo",
    shadow: tuple[str, dict] | None = None,
    idle_s: float = 0.0,
) -> dict:
    prefix = f"gorgoinstr-{uuid.uuid4().hex[:12]}"
    upstreams = [f"http://127.0.0.1:{m.port}" for m in mocks]
    bench._publish_policy(redis_url, prefix, upstreams, algorithm, shadow=shadow)
    bench._publish_bench_key(redis_url, prefix)
    out = workdir / f"callgrind-{name}.%p"
    env = {"REDIS_URL": redis_url, "GORGO_REDIS_PREFIX": prefix, "LOG_LEVEL": "info", "GORGO_AUTH": "on"}
    if pure:
        env["GORGO_PURE_PYTHON"] = "1"
    argv = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        "--trace-children=yes",  # without it the workers of --workers N ran uncounted
        f"--callgrind-out-file={out}",
        str(checkout / ".venv" / "bin" / "python"),
        "-m",
        "routing",
        *("--port", "0", "--region", "bench", "--workers", str(workers)),
    ]
    gateway = bench._start(
        f"gateway-{name}", argv, workdir, env, port_pattern=LISTENING, timeout_s=300, cwd=checkout
    )
    script = bench.wrk_script(workdir / "post.lua", bench.BENCH_SECRET)
    try:
        deadline = time.monotonic() + 120
        while (
            workers > 1 and len(re.findall(LISTENING, gateway.log_path.read_text(errors="replace"))) < workers
        ):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: not every worker is listening")
            time.sleep(1)
        bench.latency_c1(gateway.port, 100, 50, auth=bench.BENCH_SECRET)  # warm-up, not counted
        requests = _count_load_and_idle(gateway.process.pid, gateway.port, seconds, script, prefix, idle_s)
    finally:
        gateway.stop()
        bench._redis_cleanup(redis_url, prefix)
    dumps = _dumps(workdir, name, f"{prefix}-load")  # the dump taken after wrk
    total = _totals(dumps)
    idle = {}
    if idle_s > 0:
        idle_dumps = _dumps(workdir, name, f"{prefix}-idle")
        idle_total = _totals(idle_dumps)
        per_s = idle_total / idle_s
        # Not subtracted from the loaded run: under load the loops tick late and carry the
        # requests' records, so their idle cost is no measure of their share there. It is what
        # one gateway (worker) costs per second whatever its traffic: divide by a real request rate.
        idle = {
            "idle_seconds": idle_s,
            "idle_instructions_per_second": per_s,
            "idle_functions_per_second": {fn: count / idle_s for fn, count in _inclusive(idle_dumps).items()},
        }
    return {
        "name": name,
        "checkout": str(checkout),
        "pure": pure,
        "workers": workers,
        "algorithm": algorithm,
        "shadow": shadow,
        "requests": requests,
        "instructions_per_request": total / requests,
        "functions": {fn: count / requests for fn, count in _inclusive(dumps).items()},
        **idle,
    }


def measure_router(router: str, seconds: float, mocks: list, workdir: Path, idle_s: float = 0.0) -> dict:
    """The Rust vllm-router's instructions per request, counted like a gateway's (all its threads)."""
    prefix = f"gorgoinstr-{uuid.uuid4().hex[:12]}"
    port = bench.free_port()
    out = workdir / "callgrind-vllm-router.%p"
    argv = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        "--trace-children=yes",
        f"--callgrind-out-file={out}",
        router,
        "--worker-urls",
        *(f"http://127.0.0.1:{m.port}" for m in mocks),
        *("--policy", "round_robin", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"),
    ]
    target = bench._start("vllm-router", argv, workdir, port=port, timeout_s=300)
    script = bench.wrk_script(workdir / "post-router.lua")
    try:
        bench.latency_c1(port, 100, 50)  # warm-up, not counted
        requests = _count_load_and_idle(target.process.pid, port, seconds, script, prefix, idle_s)
    finally:
        target.stop()
    total = _totals(_dumps(workdir, "vllm-router", f"{prefix}-load"))
    idle = {}
    if idle_s > 0:
        idle = {
            "idle_seconds": idle_s,
            "idle_instructions_per_second": _totals(_dumps(workdir, "vllm-router", f"{prefix}-idle"))
            / idle_s,
        }
    return {
        "name": "vllm-router",
        "checkout": router,
        "requests": requests,
        "instructions_per_request": total / requests,
        "functions": {},
        **idle,
    }


def _count_load_and_idle(
    leader: int, port: int, seconds: float, script: Path, prefix: str, idle_s: float
) -> int:
    """Count instructions in ``leader``'s process group while wrk runs (dumped as
    ``<prefix>-load``) and then, for ``idle_s`` with no request, its background loops alone
    (``<prefix>-idle``); returns the requests wrk completed."""
    # Only this target's processes: without pids, callgrind_control switches every callgrind
    # run on the machine (another session's benchmark too).
    pids = [str(pid) for pid in _group_pids(leader)]
    _control("--instr=on", pids)
    _, requests = bench.run_wrk(port, seconds, script)
    _control("--instr=off", pids)
    _control(f"--dump={prefix}-load", pids)
    time.sleep(1)
    if idle_s > 0:
        _control("--zero", pids)
        _control("--instr=on", pids)
        time.sleep(idle_s)
        _control("--instr=off", pids)
        _control(f"--dump={prefix}-idle", pids)
        time.sleep(1)
    return requests


def _group_pids(leader: int) -> list[int]:
    """The live processes of ``leader``'s process group (the gateway and its workers)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == leader:
                pids.append(int(entry.name))
    return pids


def _control(action: str, pids: list[str]) -> None:
    subprocess.run(["callgrind_control", action, *pids], capture_output=True, check=False)


def _dumps(workdir: Path, name: str, label: str) -> list[Path]:
    """This variant's dumps taken with ``label`` (another session's unlabelled dump may sit beside them)."""
    found = []
    for path in workdir.glob(f"callgrind-{name}.*.*"):
        with path.open(errors="replace") as dump:
            head = [dump.readline() for _ in range(40)]  # the desc lines come first
        if any(line.startswith("desc: Trigger:") and line.rstrip().endswith(label) for line in head):
            found.append(path)
    return found


def _totals(dumps: list[Path]) -> int:
    total = 0
    for path in dumps:
        found = re.search(r"^totals: (\d+)", path.read_text(errors="replace"), re.MULTILINE)
        total += int(found.group(1)) if found else 0
    return total


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--variant", action="append", required=True, help="name=checkout[:pure|:compiled[:workers]]"
    )
    parser.add_argument("--seconds", type=float, default=8.0, help="wrk duration per variant (default 8)")
    parser.add_argument(
        "--top", type=int, default=0, help="also list this many compiled functions per request"
    )
    parser.add_argument(
        "--idle",
        type=float,
        default=0.0,
        help="after wrk, also count this many seconds without requests (the background loops alone)",
    )
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--algorithm", default="gorgo", help="the live policy's algorithm (default gorgo)")
    parser.add_argument(
        "--router",
        action="store_true",
        help="also count the Rust vllm-router (from a variant's .venv)",
    )
    parser.add_argument("--shadow-params", default="{}", help="a shadow variant's policy parameters (JSON)")
    args = parser.parse_args()
    shadow_params = json.loads(args.shadow_params)
    for tool in ("valgrind", "callgrind_control", "callgrind_annotate", "wrk"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is needed")
    variants = [_parse_variant(spec) for spec in args.variant]
    # the first variant's checkout that has it (checked before anything runs)
    router = bench.router_in([c for _, c, *_ in variants]) if args.router else None
    redis_url = bench.os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    workdir = Path(tempfile.mkdtemp(prefix="gorgo-instructions-"))
    mocks = bench.start_mocks(workdir)
    results = []
    try:
        for name, checkout, pure, workers, shadow in variants:
            row = measure(
                name,
                checkout,
                pure,
                workers,
                args.seconds,
                mocks,
                workdir,
                redis_url,
                args.algorithm,
                (shadow, shadow_params) if shadow else None,
                args.idle,
            )
            results.append(row)
            first = results[0]["instructions_per_request"]
            print(
                f"{name}: {row['requests']} requests, {row['instructions_per_request'] / 1e3:.1f} k instructions "
                f"per request ({row['instructions_per_request'] / first:.3f}x {results[0]['name']})",
                flush=True,
            )
            if args.idle:
                print(
                    f"  idle: {row['idle_instructions_per_second'] / 1e6:.1f} M instructions per second",
                    flush=True,
                )
        if router is not None:
            row = measure_router(str(router), args.seconds, mocks, workdir, args.idle)
            results.append(row)
            first = results[0]["instructions_per_request"]
            print(
                f"vllm-router: {row['requests']} requests, {row['instructions_per_request'] / 1e3:.1f} k "
                f"instructions per request ({row['instructions_per_request'] / first:.3f}x {results[0]['name']})",
                flush=True,
            )
    finally:
        for mock in mocks:
            mock.stop()
    if args.top:
        names = sorted(
            {fn for row in results for fn in row["functions"]},
            key=lambda fn: -max(row["functions"].get(fn, 0) for row in results),
        )[: args.top]
        print("\nk instructions per request, inclusive: " + " | ".join(row["name"] for row in results))
        for fn in names:
            print(" | ".join(f"{row['functions'].get(fn, 0) / 1e3:8.1f}" for row in results) + f"  {fn}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
