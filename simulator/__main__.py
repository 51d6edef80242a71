"""``python -m simulator``: serve the emulated vLLM nodes of a topology until SIGINT/SIGTERM.

    python -m simulator --topology simulator/topologies/default.toml
    python -m simulator --only us-east-1 --auto-ports      # one node on a free port
    python -m simulator --auto-ports --region-ports --engine prefill_tokens_per_s=10000 --json

Prints one line per node (node, region, URL) once every node listens, then a ``ready`` line.
With ``--json`` the table is one JSON object instead (``{"nodes": [{"name", "region", "url",
"region_urls"}]}``), for scripts. ``--region-ports`` adds one port per region to every node: a
request there pays that region's WAN delay without the ``X-Gorgo-Region`` header.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from typing import Any

from simulator.control import serve_control
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
    parser.add_argument(
        "--skip-region",
        default=None,
        help="serve no node of this region (GORGO_FLEET=vllm make run serves it with real vLLM)",
    )
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
    parser.add_argument(
        "--region-ports",
        action="store_true",
        help="also serve each node on one port per region, which applies that region's RTT",
    )
    parser.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override an engine parameter of every node (repeatable), e.g. kv_capacity_blocks=4096",
    )
    parser.add_argument(
        "--engine-default",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="replace the topology's [engine] default (repeatable); a node's own [nodes.engine] entry "
        "still wins, so a fleet of mixed GPUs stays mixed",
    )
    parser.add_argument(
        "--kv-events-config",
        action="append",
        default=[],
        metavar="[NODE=]JSON",
        help="vLLM's --kv-events-config for NODE (repeatable; without NODE= when serving one node), "
        'e.g. \'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}\'',
    )
    parser.add_argument(
        "--enable-prompt-tokens-details",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM's flag: report usage.prompt_tokens_details.cached_tokens (default: the topology's "
        "enable_prompt_tokens_details; vLLM's own default is off)",
    )
    parser.add_argument("--json", action="store_true", help="print the nodes as one JSON line")
    parser.add_argument(
        "--oracle",
        action="store_true",
        help="log each chat request's lower-bound TTFT (GET /oracle on the control API; benchmarks)",
    )
    parser.add_argument(
        "--control-port",
        type=int,
        default=None,
        help="serve the fault-injection API (crash/restart nodes; simulator.control) on this port",
    )
    return parser


def parse_engine_overrides(items: list[str]) -> dict[str, int | float]:
    """``["name=value", ...]`` -> overrides; integers stay integers (the engine checks the names)."""
    overrides: dict[str, int | float] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"an engine parameter is NAME=VALUE, got {item!r}")
        try:
            value: int | float = int(raw)
        except ValueError:
            try:
                value = float(raw)
            except ValueError:
                raise ValueError(f"engine parameter {name}: {raw!r} is not a number") from None
        overrides[name.strip()] = value
    return overrides


def parse_kv_events_args(items: list[str], served: list[str]) -> dict[str, str]:
    """``["NODE={...}", "{...}"]`` -> node name -> JSON; a bare JSON needs exactly one served node."""
    configs: dict[str, str] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        if sep and not name.lstrip().startswith("{"):
            configs[name.strip()] = raw
        elif len(served) == 1:
            configs[served[0]] = item
        else:
            raise ValueError("--kv-events-config without NODE= needs exactly one node (use --only NODE)")
    return configs


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        topology = load_topology(args.topology)
        only = [name.strip() for name in args.only.split(",") if name.strip()] if args.only else None
        if args.skip_region:
            only = [
                node.name
                for node in topology.nodes
                if node.region != args.skip_region and (only is None or node.name in only)
            ]
        served = only if only is not None else [node.name for node in topology.nodes]
        fleet = Fleet.start(
            topology,
            host=args.host,
            auto_ports=args.auto_ports,
            port_offset=args.port_offset,
            only=only,
            engine_overrides=parse_engine_overrides(args.engine),
            engine_defaults=parse_engine_overrides(args.engine_default),
            time_scale=args.time_scale,
            region_ports=args.region_ports,
            kv_events=parse_kv_events_args(args.kv_events_config, served),
            enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        )
    except (TopologyError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.oracle:
        fleet.record_oracle()
    try:
        return run(_serve(fleet, as_json=args.json, control_port=args.control_port))
    except OSError as exc:  # typically a port already in use
        print(f"error: cannot listen: {exc}", file=sys.stderr)
        return 1


async def _serve(fleet: Fleet, *, as_json: bool = False, control_port: int | None = None) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    async with fleet:
        control = None
        if control_port is not None:
            control = await serve_control(fleet, "127.0.0.1", control_port)  # fault injection: loopback only
            print(f"control API on http://127.0.0.1:{control_port} (python -m simulator.control)", flush=True)
        print(json.dumps(describe(fleet)) if as_json else format_table(fleet), flush=True)
        print(f"{READY_LINE}: {len(fleet.nodes)} node(s); stop with Ctrl-C", flush=True)
        await stop.wait()
        print("simulator stopping", flush=True)
        if control is not None:
            await control.cleanup()
    return 0


def describe(fleet: Fleet) -> dict[str, Any]:
    """The fleet's nodes and their URLs, as ``--json`` prints them."""
    return {
        "nodes": [
            {
                "name": n.name,
                "region": n.region,
                "url": n.url,
                "region_urls": dict(n.region_urls),
                "kv_events_endpoint": n.kv_events_endpoint,
                "kv_events_replay_endpoint": n.kv_events_replay_endpoint,
            }
            for n in fleet.nodes.values()
        ]
    }


def format_table(fleet: Fleet) -> str:
    regions = [region.slug for region in fleet.topology.regions] if fleet.region_ports else []
    rows = [("node", "region", "url", *(f"as {region}" for region in regions))] + [
        (n.name, n.region, n.url, *(n.region_urls.get(region, "") for region in regions))
        for n in fleet.nodes.values()
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in rows)


if __name__ == "__main__":
    sys.exit(main())
