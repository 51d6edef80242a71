"""The client-side HTTP server alone: the gateway's own (issue 25) against uvicorn's ASGI cycle.

    python benchmarks/client_side_cpu.py            # from the repo root; ~1 minute, needs wrk

Both servers answer every POST with the same fixed JSON (head and body), after reading the request
body, on uvloop + httptools: ``own`` is ``routing/http/client_side.py`` calling a handler with a
``ClientRequest``; ``uvicorn`` is a raw ASGI app on uvicorn (scope, receive, send). No routing,
no upstream: what is left is the server's cost per request. Both are up together and take turns,
``--rounds`` rounds of ``wrk -t1 -c32`` for ``--seconds`` each (the order alternates); CPU per
request is the server process's user + system time from /proc over its wrk run. The figure is the
median over the rounds of each round's ratio (uvicorn / own), so the machine's drift cancels.
Writes benchmarks/results/client_side_cpu.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gateway_overhead import Target, _start, group_cpu_s, throughput_c32  # same directory
from overhead_servers import run_uvicorn

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BODY = b'{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"}}]}'
HEADERS = [(b"content-type", b"application/json"), (b"x-gorgo-node", b"node-1")]


def serve_own() -> None:
    import uvloop

    from routing.config import GatewayConfig
    from routing.http.client_side import ClientRequest, ClientStats, connection_factory
    from routing.http.server import listening_socket

    async def handler(request: ClientRequest) -> None:
        await request.body(None, 1 << 20)
        request.respond(200, HEADERS, BODY)

    async def main() -> None:
        config = GatewayConfig(region="bench", gateway_id="bench")
        sock = listening_socket("127.0.0.1", 0, reuse_port=False)
        loop = asyncio.get_running_loop()
        await loop.create_server(connection_factory(handler, config, ClientStats()), sock=sock)
        print(f"READY {sock.getsockname()[1]}", flush=True)
        await asyncio.Event().wait()

    uvloop.run(main())


def serve_uvicorn() -> None:
    headers = [*HEADERS, (b"content-length", str(len(BODY)).encode())]

    async def app(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        if scope["type"] != "http":
            return
        message = await receive()
        while message.get("more_body"):
            message = await receive()
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": BODY})

    run_uvicorn(app, lifespan="off", server_header=False, date_header=False)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--serve", choices=("own", "uvicorn"), help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=9, help="at least 2 (the report gives the IQR)")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.rounds < 2 or args.seconds <= 0:
        parser.error("--rounds must be at least 2 and --seconds above 0")
    if args.serve == "own":
        serve_own()
        return 0
    if args.serve == "uvicorn":
        serve_uvicorn()
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="gorgo-client-side-"))
    me = [sys.executable, str(Path(__file__).resolve())]
    servers: list[Target] = [
        _start("own", [*me, "--serve", "own"], workdir, port_pattern=r"READY (\d+)"),
        _start(
            "uvicorn",
            [*me, "--serve", "uvicorn"],
            workdir,
            port_pattern=r"Uvicorn running on http://127\.0\.0\.1:(\d+)",
        ),
    ]
    servers[0].name, servers[1].name = "own", "uvicorn"
    load_at_start = os.getloadavg()
    rounds: list[dict[str, float]] = []
    try:
        for index in range(args.rounds):
            figures: dict[str, float] = {}
            for server in servers if index % 2 == 0 else servers[::-1]:
                before = group_cpu_s(server.process.pid)
                _, done, loadgen = throughput_c32(server.port, args.seconds)
                figures[server.name] = (group_cpu_s(server.process.pid) - before) / done * 1e6
            rounds.append(figures)
            print(
                f"  round {index + 1}: " + ", ".join(f"{k} {v:.1f} µs" for k, v in figures.items()),
                flush=True,
            )
    finally:
        for server in servers:
            server.stop()
    ratios = [each["uvicorn"] / each["own"] for each in rounds]
    q1, median_ratio, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    report = {
        "generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_avg_1_5_15_at_start": [round(v, 2) for v in load_at_start],
            "load_avg_1_5_15_at_end": [round(v, 2) for v in os.getloadavg()],
        },
        "method": f"{args.rounds} rounds, {loadgen} for {args.seconds:g} s per server in turns",
        "cpu_us_per_request_median": {
            name: round(statistics.median(each[name] for each in rounds), 1) for name in ("own", "uvicorn")
        },
        "uvicorn_over_own": {"median": round(median_ratio, 3), "iqr": [round(q1, 3), round(q3, 3)]},
        "rounds": [{name: round(value, 1) for name, value in each.items()} for each in rounds],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "client_side_cpu.json").write_text(json.dumps(report, indent=2) + "\n")
    medians = report["cpu_us_per_request_median"]
    markdown = "\n".join(
        [
            "# The client-side server alone",
            "",
            f"Generated by `python benchmarks/client_side_cpu.py` on {report['generated_at']}; "
            f"{report['method']}; the same fixed answer from both; load average {report['machine']['load_avg_1_5_15_at_start']} "
            f"at the start, {report['machine']['load_avg_1_5_15_at_end']} at the end.",
            "",
            "| server | CPU µs per request (median of rounds, user + system) |",
            "|---|---:|",
            f"| own (`routing/http/client_side.py`) | {medians['own']:g} |",
            f"| uvicorn (httptools, raw ASGI app) | {medians['uvicorn']:g} |",
            "",
            f"uvicorn / own, per round: median **{median_ratio:.2f}x** (IQR {q1:.2f} to {q3:.2f}).",
            "",
        ]
    )
    (args.out / "client_side_cpu.md").write_text(markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
