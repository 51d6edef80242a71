"""``python -m simulator``: serve the emulated vLLM nodes of a topology until SIGINT/SIGTERM.

    python -m simulator --topology simulator/topologies/default.toml
    python -m simulator --only us-east-1 --auto-ports      # one node on a free port

Prints one line per node (node, region, URL) once every node listens, then a ``ready`` line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys

from simulator.fleet import Fleet
from simulator.runtime import run
from simulator.topology import DEFAULT_TOPOLOGY_PATH, TopologyError, load_topology

READY_LINE = "simulator ready"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m simulator", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--topology", default=str(DEFAULT_TOPOLOGY_PATH), help="topology TOML file (default: the demo fleet)"
    )
    parser.add_argument("--host", default=None, help="listen on this address instead of each node's host")
    parser.add_argument("--only", default=None, help="comma-separated node names to serve (default: all)")
    parser.add_argument("--port-offset", type=int, default=0, help="add N to every configured port")
    parser.add_argument(
        "--auto-ports", action="store_true", help="let the OS pick free ports (printed in the table)"
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiply every emulated duration (engine steps, WAN delays); 0.1 runs 10x faster",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        topology = load_topology(args.topology)
        only = [name.strip() for name in args.only.split(",") if name.strip()] if args.only else None
        fleet = Fleet.start(
            topology,
            host=args.host,
            auto_ports=args.auto_ports,
            port_offset=args.port_offset,
            only=only,
            time_scale=args.time_scale,
        )
    except (TopologyError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        return run(_serve(fleet))
    except OSError as exc:  # typically a port already in use
        print(f"error: cannot listen: {exc}", file=sys.stderr)
        return 1


async def _serve(fleet: Fleet) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    async with fleet:
        print(format_table(fleet), flush=True)
        print(f"{READY_LINE}: {len(fleet.nodes)} node(s); stop with Ctrl-C", flush=True)
        await stop.wait()
        print("simulator stopping", flush=True)
    return 0


def format_table(fleet: Fleet) -> str:
    rows = [("node", "region", "url")] + [(n.name, n.region, n.url) for n in fleet.nodes.values()]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in rows)


if __name__ == "__main__":
    sys.exit(main())
