"""Instructions per request of the client side alone (callgrind), with no timers to blur them.

    python benchmarks/gateway_client_side_instructions.py --checkout /work/main --checkout . [--requests 4000]

``gateway_instructions.py`` counts the whole gateway, whose timed background loops weigh ~50 k
instructions a request under valgrind and move with how many requests valgrind served: a change
of ~1-2 % drowns there. This drives only ``routing.http.client_side`` (compiled when the checkout
has its build) on uvloop in one process: 8 kept-alive connections send ``--requests`` requests in
turn, each answered after one suspension of its handler (as a proxied request waits on its node),
and counts the process's instructions with and without them; the difference per request is the
client side's own work and the asyncio machinery around a request (the client's socket work
included, the same for every checkout).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

_DRIVER = r"""
import asyncio, sys
import uvloop
import routing  # installs the compiled modules' finder
from routing.config import GatewayConfig
from routing.http.client_side import ClientConnection, ClientStats

REQUESTS = int(sys.argv[1])
CONNECTIONS = 8
HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


async def handler(request):
    await request.body(2, 1 << 20)
    await asyncio.sleep(0)  # one suspension, as a proxied request waits on its node
    request.respond(200, [(b"content-type", b"application/json"), (b"x-request-id", b"abc")], b"{}")


async def client(port, count):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for _ in range(count):
        writer.write(HEAD)
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
    writer.close()


async def main():
    config = GatewayConfig(region="bench", gateway_id="gw")
    stats = ClientStats()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: ClientConnection(handler, config, stats), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    await asyncio.gather(*(client(port, REQUESTS // CONNECTIONS) for _ in range(CONNECTIONS)))
    server.close()
    await server.wait_closed()


uvloop.run(main())
"""


def _count(checkout: Path, requests: int, workdir: Path) -> int:
    driver = workdir / "driver.py"
    driver.write_text(_DRIVER)
    out = workdir / f"callgrind.{checkout.name or 'root'}.{requests}"
    subprocess.run(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
         str(checkout / ".venv" / "bin" / "python"), str(driver), str(requests)],
        cwd=checkout, capture_output=True, check=True, timeout=900,
        env={**os.environ, "PYTHONPATH": str(checkout)},  # its routing, whatever the venv's install points at
    )  # fmt: skip
    found = re.search(r"^totals: (\d+)", out.read_text(errors="replace"), re.MULTILINE)
    assert found is not None
    return int(found.group(1))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkout", action="append", required=True, type=Path)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="gorgo-client-side-"))
    rows = []
    for checkout in args.checkout:
        checkout = checkout.resolve()
        base = _count(checkout, 0, workdir)
        loaded = _count(checkout, args.requests, workdir)
        per_request = (loaded - base) / args.requests
        rows.append(
            {"checkout": str(checkout), "requests": args.requests, "instructions_per_request": per_request}
        )
        print(f"{checkout}: {per_request / 1e3:.2f} k instructions per request", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
