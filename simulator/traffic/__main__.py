"""``python -m simulator.traffic``: send a seeded open-loop workload and report TTFT per client region.

    python -m simulator.traffic --workload geo-chat \\
        --target us-east=http://127.0.0.1:9001 --target eu-central=http://127.0.0.1:9002 \\
        --rate 2 --duration 60 --seed 1 --out results.jsonl

Bounded: it stops sending after ``--duration`` seconds or ``--max-requests`` requests (whichever
comes first), waits at most ``--drain`` seconds for answers in flight, and stops early on
SIGINT/SIGTERM. Results go to ``--out`` as JSON lines as they finish.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import signal
import sys
from pathlib import Path
from typing import IO

import msgspec

from simulator.runtime import run
from simulator.topology import DEFAULT_MODEL
from simulator.traffic.report import format_summary, summarize
from simulator.traffic.runner import RequestResult, run_plan
from simulator.traffic.workloads import WORKLOADS, WorkloadPlan, build_plan


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m simulator.traffic", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=WORKLOADS, default="geo-chat")
    parser.add_argument(
        "--target",
        action="append",
        required=True,
        metavar="REGION=URL",
        help="clients in REGION send to URL (a gateway, or a node); repeat per region",
    )
    parser.add_argument("--rate", type=float, default=1.0, help="mean requests per second (Poisson)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds to keep sending")
    parser.add_argument(
        "--max-requests",
        type=int,
        default=None,
        help="hard cap on requests (default: twice the expected count, plus 100)",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="write one JSON line per request here")
    parser.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stream answers (needed for TTFT; default on)",
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument(
        "--region-header",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send X-Gorgo-Region: <client region> (default on)",
    )
    parser.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        help="a file holding the gorgo client key to send (Authorization: Bearer); "
        "else $GORGO_API_KEY, else none",
    )
    parser.add_argument("--request-timeout", type=float, default=120.0, help="seconds per request")
    parser.add_argument("--drain", type=float, default=30.0, help="seconds to wait for answers at the end")
    parser.add_argument(
        "--progress", type=float, default=30.0, help="print progress every N seconds (0: never)"
    )
    return parser


def parse_targets(values: list[str]) -> dict[str, str]:
    targets: dict[str, str] = {}
    for value in values:
        region, sep, url = value.partition("=")
        if not sep or not region or not url.startswith(("http://", "https://")):
            raise ValueError(f"--target must be REGION=http://host:port, got {value!r}")
        targets[region.strip()] = url.strip()
    return targets


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        targets = parse_targets(args.target)
        max_requests = (
            args.max_requests
            if args.max_requests is not None
            else math.ceil(args.rate * args.duration * 2) + 100
        )
        plan = build_plan(
            args.workload,
            list(targets),
            rate_rps=args.rate,
            duration_s=args.duration,
            max_requests=max_requests,
            seed=args.seed,
            max_tokens=args.max_tokens,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"traffic: {args.workload}, {len(plan.arrivals)} requests over {args.duration:g}s "
        f"at ~{args.rate:g} rps from {', '.join(targets)} (seed {args.seed})",
        flush=True,
    )
    return run(_main(args, plan, targets))


async def _main(args: argparse.Namespace, plan: WorkloadPlan, targets: dict[str, str]) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    out: IO[bytes] | None = args.out.open("wb") if args.out else None
    done: list[RequestResult] = []
    encoder = msgspec.json.Encoder()

    def on_result(result: RequestResult) -> None:
        done.append(result)
        if out is not None:
            out.write(encoder.encode(result) + b"\n")

    progress = loop.create_task(_report_progress(done, len(plan.arrivals), args.progress))
    try:
        results = await run_plan(
            plan,
            targets,
            model=args.model,
            stream=args.stream,
            region_header=args.region_header,
            request_timeout_s=args.request_timeout,
            drain_timeout_s=args.drain,
            on_result=on_result,
            stop=stop,
            api_key=args.api_key_file.read_text().strip()
            if args.api_key_file
            else os.environ.get("GORGO_API_KEY"),
        )
    finally:
        progress.cancel()
        if out is not None:
            out.close()
    print(format_summary(summarize(results)), flush=True)
    if args.out:
        print(f"results: {args.out}", flush=True)
    return 0


async def _report_progress(done: list[RequestResult], planned: int, every_s: float) -> None:
    if every_s <= 0:
        return
    while True:
        await asyncio.sleep(every_s)
        errors = sum(1 for r in done if not r.ok)
        print(f"traffic: {len(done)}/{planned} done, {errors} errors", flush=True)


if __name__ == "__main__":
    sys.exit(main())
