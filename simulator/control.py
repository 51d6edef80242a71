"""Fault injection for a running emulated fleet: crash and restart nodes on demand.

A real fleet loses nodes; operators (and the demo) need to see gorgo notice and route around it.
``python -m simulator --control-port 8199`` serves a small JSON API next to the nodes:

    GET  /nodes                 every node: name, region, url, up
    POST /nodes/{name}/stop     crash the node: streams in flight are cut, its port closes
    POST /nodes/{name}/start    restart it on the same port with an empty KV cache
    POST /reset                 every node restarted as a new fleet process would start it (empty KV
                                caches, zeroed counters, the WAN jitter's seeded sequence from its
                                start), the oracle's log emptied (``Fleet.reset``; benchmarks)
    GET  /oracle                each chat request's lower-bound TTFT so far (``Fleet.record_oracle``;
                                benchmarks): {"requests": {key: [client region, ms, its RTT ms,
                                its step + prefill ms]}, "served": {key: [node, intake ms, queued ms,
                                prefill ms, ms written late]}}

and ``python -m simulator.control {list,stop,start} [NODE] [--url http://127.0.0.1:8199]`` calls it.
The control port is not part of vLLM's interface; it only exists on emulated fleets.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request

from aiohttp import web

from simulator.fleet import Fleet

DEFAULT_CONTROL_URL = "http://127.0.0.1:8199"
_FLEET_KEY: web.AppKey[Fleet] = web.AppKey("fleet", Fleet)


def describe_nodes(fleet: Fleet) -> list[dict[str, object]]:
    return [{"name": n.name, "region": n.region, "url": n.url, "up": n.running} for n in fleet.nodes.values()]


async def _list(request: web.Request) -> web.Response:
    return web.json_response({"nodes": describe_nodes(request.app[_FLEET_KEY])})


async def _change(request: web.Request) -> web.Response:
    fleet = request.app[_FLEET_KEY]
    name, action = request.match_info["name"], request.match_info["action"]
    if name not in fleet.nodes:
        return web.json_response({"error": f"no node named {name!r}"}, status=404)
    node = fleet.nodes[name]
    if action == "stop" and node.running:
        await fleet.stop_node(name)
    elif action == "start" and not node.running:
        await fleet.start_node(name)
    return web.json_response({"name": name, "up": node.running})


async def _reset(request: web.Request) -> web.Response:
    fleet = request.app[_FLEET_KEY]
    await fleet.reset()
    return web.json_response({"nodes": describe_nodes(fleet)})


async def _oracle(request: web.Request) -> web.Response:
    fleet = request.app[_FLEET_KEY]
    return web.json_response({"requests": fleet.oracle_ms, "served": fleet.served_ms})


def build_app(fleet: Fleet) -> web.Application:
    app = web.Application()
    app[_FLEET_KEY] = fleet
    app.router.add_get("/nodes", _list)
    app.router.add_get("/oracle", _oracle)
    app.router.add_post("/reset", _reset)
    app.router.add_post("/nodes/{name}/{action:(stop|start)}", _change)
    return app


async def serve_control(fleet: Fleet, host: str, port: int) -> web.AppRunner:
    """Start the control API; the caller cleans the returned runner up."""
    runner = web.AppRunner(build_app(fleet), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulator.control", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["list", "stop", "start"])
    parser.add_argument("node", nargs="?", help="node name (stop/start)")
    parser.add_argument(
        "--url", default=DEFAULT_CONTROL_URL, help=f"control API (default {DEFAULT_CONTROL_URL})"
    )
    args = parser.parse_args(argv)
    if args.action != "list" and not args.node:
        parser.error(f"{args.action} needs a node name")
    if args.action == "list":
        request = urllib.request.Request(f"{args.url}/nodes")
    else:
        request = urllib.request.Request(
            f"{args.url}/nodes/{args.node}/{args.action}", method="POST", data=b""
        )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            body = json.load(response)
    except urllib.error.HTTPError as exc:
        print(f"error: {json.load(exc).get('error', exc)}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"error: cannot reach the simulator's control API at {args.url}: {exc}", file=sys.stderr)
        return 1
    for node in body.get("nodes", [body]):
        print(f"{node['name']:<14} {'up' if node['up'] else 'DOWN'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
