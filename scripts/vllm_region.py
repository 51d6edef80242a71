#!/usr/bin/env python3
"""Serve one region's nodes of a topology as REAL vLLM CPU servers (``GORGO_FLEET=vllm make run``).

    .venv/bin/python scripts/vllm_region.py --region ap-south

For every node of the region: ``vllm serve`` of the tiny random-weight Llama (scripts/
ensure_tiny_model.py) under the node's model name, on the node's port, with the node's KV-event
endpoints (``*`` endpoints are bound, as vLLM does), ``--enable-prefix-caching``,
``--enable-prompt-tokens-details`` and ``--block-size 32`` (the CPU build's smallest). The
emulator serves the other regions (``python -m simulator --skip-region REGION``). Installs vLLM
first if needed (scripts/ensure_vllm.py: ~4 minutes once). Stops its servers, by their process
groups, on SIGINT/SIGTERM.

Real servers do not emulate WAN delay, cannot be crashed through the simulator's control API, and
use 32-token blocks where the demo model says 16: the gateway's precise index takes a node's block
size from its events (the replay on subscription included), the model's ``kv_block_size`` only
before the node has sent any.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from simulator.harness import stop_process_group  # noqa: E402
from simulator.topology import DEFAULT_TOPOLOGY_PATH, load_topology  # noqa: E402
from tests.real_vllm import MODEL_FOLDER, VLLM_PYTHON, server_env  # noqa: E402


def argv_for(node, block_size: int) -> list[str]:  # type: ignore[no-untyped-def]
    argv = [
        str(VLLM_PYTHON.parent / "vllm"),
        "serve",
        str(MODEL_FOLDER),
        "--served-model-name",
        node.model,
        "--host",
        node.host,
        "--port",
        str(node.port),
        "--block-size",
        str(block_size),
        "--max-model-len",
        "4096",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--enforce-eager",
        "--disable-uvicorn-access-log",
    ]
    events = node.kv_events
    if events is not None and events.enabled:
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": events.endpoint,
            "replay_endpoint": events.replay_endpoint,
            "topic": events.topic,
        }
        argv += ["--kv-events-config", json.dumps({k: v for k, v in config.items() if v is not None})]
    return argv


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topology", default=str(DEFAULT_TOPOLOGY_PATH))
    parser.add_argument("--region", required=True)
    parser.add_argument("--block-size", type=int, default=32)
    args = parser.parse_args()
    nodes = [node for node in load_topology(args.topology).nodes if node.region == args.region]
    if not nodes:
        print(f"vllm_region: no node in region {args.region!r}", file=sys.stderr)
        return 2
    started = time.monotonic()
    if subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "ensure_vllm.py")], stdout=subprocess.DEVNULL
    ).returncode:
        return 1
    subprocess.run(
        [str(VLLM_PYTHON), str(ROOT / "scripts" / "ensure_tiny_model.py")], check=True, env=server_env()
    )
    servers = [
        subprocess.Popen(argv_for(node, args.block_size), cwd=ROOT, env=server_env(), start_new_session=True)
        for node in nodes
    ]
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    print(f"vllm_region: starting {', '.join(n.name for n in nodes)} as real vLLM", flush=True)
    announced = False
    while not stopping:
        if any(server.poll() is not None for server in servers):
            print("vllm_region: a vLLM server exited; stopping the others", file=sys.stderr, flush=True)
            break
        if not announced and all(_healthy(node.url) for node in nodes):
            print(f"vllm_region: ready after {time.monotonic() - started:.0f} s", flush=True)
            announced = True
        time.sleep(1.0)
    for server in servers:
        stop_process_group(server, signal.SIGTERM, timeout_s=20.0)
    return 0


def _healthy(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1.0) as response:
            return response.status == 200
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
