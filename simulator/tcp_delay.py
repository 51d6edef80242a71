"""A TCP delay proxy: shared state (Redis) one emulated WAN round trip away.

``simulator/wan.py`` delays HTTP requests to nodes; this delays any TCP byte stream, so a gateway's
Redis client can be made to pay another region's round trip (issue 24, item 2). Each byte reaches
the other side ``rtt_ms / 2`` after it was read, in both directions, in order; throughput is not
limited (a WAN's latency, not its bandwidth, is what the request path feels). Loopback only.

    proxy = TcpDelayProxy("127.0.0.1", 6379, rtt_ms=120)
    port = await proxy.start()         # redis://127.0.0.1:<port>/0 now answers 120 ms later
    ...
    await proxy.close()

or as a process, one proxy per ``--rtt-ms`` (prints one JSON line ``{"ports": [...]}`` when ready,
then runs until SIGTERM)::

    python -m simulator.tcp_delay --upstream 127.0.0.1:6379 --rtt-ms 88 --rtt-ms 235
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal

_CHUNK_BYTES = 65_536


class TcpDelayProxy:
    """Listens on 127.0.0.1 and forwards every connection to ``upstream`` with a delay each way."""

    def __init__(self, upstream_host: str, upstream_port: int, *, rtt_ms: float) -> None:
        if upstream_host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError("the delay proxy forwards to loopback only")
        self._upstream = (upstream_host, upstream_port)
        self.one_way_s = rtt_ms / 2000.0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        """Start listening on a free loopback port; returns it."""
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._server is not None:
            await self._server.wait_closed()

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self._upstream)
        except OSError:
            client_writer.close()
            return
        for reader, writer in ((client_reader, upstream_writer), (upstream_reader, client_writer)):
            task = asyncio.create_task(self._pipe(reader, writer))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Read as fast as bytes come; a second task writes each chunk once its delay is over."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, chunk = await queue.get()
                if not chunk:
                    break
                wait_s = due - loop.time()
                if wait_s > 0:
                    await asyncio.sleep(wait_s)
                writer.write(chunk)
                await writer.drain()
            # The end of the stream arrives delayed too, after the bytes before it.
            wait_s = due - loop.time()
            if wait_s > 0:
                await asyncio.sleep(wait_s)

        delivering = asyncio.create_task(deliver())
        try:
            while True:
                chunk = await reader.read(_CHUNK_BYTES)
                queue.put_nowait((loop.time() + self.one_way_s, chunk))
                if not chunk:
                    break
            await delivering
        except (ConnectionError, OSError):
            pass
        finally:
            delivering.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await delivering
            writer.close()


async def serve(upstream_host: str, upstream_port: int, rtts_ms: list[float]) -> None:
    """Run one proxy per round trip until SIGTERM or SIGINT; print their ports first."""
    proxies = [TcpDelayProxy(upstream_host, upstream_port, rtt_ms=rtt_ms) for rtt_ms in rtts_ms]
    ports = [await proxy.start() for proxy in proxies]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    print(json.dumps({"ports": ports}), flush=True)
    try:
        await stop.wait()
    finally:
        for proxy in proxies:
            await proxy.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="TCP delay proxies in front of one loopback server")
    parser.add_argument("--upstream", default="127.0.0.1:6379", help="HOST:PORT on loopback")
    parser.add_argument("--rtt-ms", type=float, action="append", required=True, help="one proxy per value")
    args = parser.parse_args(argv)
    host, _, port = args.upstream.rpartition(":")
    asyncio.run(serve(host or "127.0.0.1", int(port), args.rtt_ms))


if __name__ == "__main__":
    main()
