"""Run the gateway: its lifespan, its listening socket, a graceful stop, and several workers.

One process (``--workers 1``): ``Gateway.startup`` (Redis, the upstream client, the background
loops), then listen; on SIGTERM or SIGINT stop accepting, close idle connections, let the answers
under way finish for at most ``GORGO_SHUTDOWN_GRACE_S``, close what is left, ``Gateway.shutdown``
(the request log flushed), exit.

Several (``--workers N``): a parent process reserves the port and starts N workers; each binds its
own listening socket to it with ``SO_REUSEPORT``, so the kernel spreads new connections over them
(no accept lock, no thundering herd) and each worker is a gateway of its own (own id, own
in-flight counts, shared through Redis like separate gateways). The parent watches them: one that
dies is started again; SIGTERM (or SIGINT) is forwarded, and the parent exits once every worker
has drained and exited.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import socket
import sys
import time

from routing.app import Gateway
from routing.config import GatewayConfig
from routing.http.client_side import ClientConnection, connection_factory

logger = logging.getLogger("routing.server")

_BACKLOG = 2048
_REQUESTS_END_S = 5.0  # after the grace period: for cancelled requests to record themselves
_RESTART_PAUSE_S = 1.0  # between a worker's death and its replacement: a crash loop stays slow


def listening_socket(host: str, port: int, *, reuse_port: bool) -> socket.socket:
    """A bound TCP socket for ``host:port`` (not yet listening)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class GatewayServer:
    """One process's gateway behind its listening socket."""

    def __init__(self, gateway: Gateway, config: GatewayConfig) -> None:
        self.gateway = gateway
        self.config = config
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self, sock: socket.socket) -> None:
        """Open the gateway's clients, then accept on ``sock``."""
        await self.gateway.startup()
        loop = asyncio.get_running_loop()
        factory = connection_factory(self.gateway.handle, self.config, self.gateway.client_stats)
        self._server = await loop.create_server(factory, sock=sock, backlog=_BACKLOG)
        self.port = sock.getsockname()[1]

    async def stop(self) -> None:
        """Stop accepting, drain the answers under way (bounded), close, shut the gateway down."""
        if self._server is not None:
            self._server.close()
        stats = self.gateway.client_stats
        connections: set[ClientConnection] = stats.connections
        stats.drained = drained = asyncio.Event()
        for connection in list(connections):
            connection.shutdown()
        if connections:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(drained.wait(), self.config.shutdown_grace_s)
        for connection in list(connections):
            connection.transport.close()  # past the grace period: the request hears a disconnect
        if stats.requests:  # let them end (cancelled ones record a 499) before the log is flushed
            await asyncio.wait(set(stats.requests), timeout=_REQUESTS_END_S)
        await self.gateway.shutdown()


async def serve(
    config: GatewayConfig,
    sock: socket.socket,
    stop: asyncio.Event,
    *,
    gateway: Gateway | None = None,
) -> None:
    """Serve on ``sock`` until ``stop`` is set, then stop gracefully."""
    server = GatewayServer(gateway if gateway is not None else Gateway(config), config)
    await server.start(sock)
    logger.info("listening on http://%s:%d (pid %d)", config.host, server.port, os.getpid())
    try:
        await stop.wait()
    finally:
        await server.stop()


def _run_process(config: GatewayConfig, sock: socket.socket) -> int:
    """One gateway process on ``sock``, until SIGTERM or SIGINT."""
    import uvloop

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await serve(config, sock, stop)

    try:
        uvloop.run(main())
    except Exception:
        logger.exception("the gateway failed")
        return 3
    return 0


def _worker(port: int) -> None:
    """A worker process: its own configuration (its own gateway id) and listening socket."""
    # The parent's handlers are not the worker's: its loop handles SIGTERM and SIGINT (Ctrl-C in a
    # terminal reaches the whole process group) as a graceful stop.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    config = GatewayConfig.from_env()
    sock = listening_socket(config.host, port, reuse_port=True)
    sys.exit(_run_process(config, sock))


def run(config: GatewayConfig) -> int:
    """``python -m routing``: one process, or a parent and ``config.workers`` workers."""
    if config.workers == 1:
        try:
            sock = listening_socket(config.host, config.port, reuse_port=False)
        except OSError as exc:
            logger.error("cannot listen on %s:%d: %s", config.host, config.port, exc)
            return 1
        return _run_process(config, sock)
    return _supervise(config)


def _supervise(config: GatewayConfig) -> int:
    """Start ``config.workers`` workers on one port, restart one that dies, forward SIGTERM."""
    # Bound (not listening) with SO_REUSEPORT: the port is ours, port 0 becomes a real one, and
    # only the workers' listening sockets receive connections.
    try:
        reserved = listening_socket(config.host, config.port, reuse_port=True)
    except OSError as exc:
        logger.error("cannot listen on %s:%d: %s", config.host, config.port, exc)
        return 1
    port = reserved.getsockname()[1]
    # Forked before any event loop or thread exists in this process: a cheap, clean start.
    context = multiprocessing.get_context("fork")
    stopping = False
    exit_code = 0

    def start() -> multiprocessing.process.BaseProcess:
        process = context.Process(target=_worker, args=(port,), name="gorgo-gateway-worker")
        process.start()
        return process

    def stop_all(_signum: int = 0, _frame: object = None) -> None:
        nonlocal stopping
        if stopping:
            return
        stopping = True
        logger.info("stopping %d workers: draining", len(workers))
        for process in workers:
            if process.pid is not None and process.is_alive():
                os.kill(process.pid, signal.SIGTERM)

    workers = [start() for _ in range(config.workers)]
    signal.signal(signal.SIGTERM, stop_all)
    signal.signal(signal.SIGINT, stop_all)
    logger.info(
        "supervising %d workers on http://%s:%d (pid %d)", config.workers, config.host, port, os.getpid()
    )
    while workers:
        time.sleep(0.2)
        for process in [process for process in workers if not process.is_alive()]:
            process.join()
            workers.remove(process)
            if stopping:
                continue
            if process.exitcode == 3:  # its start-up failed: another would fail the same way
                logger.error("worker %d failed at start; stopping", process.pid)
                exit_code = 1
                stop_all()
                continue
            logger.warning("worker %d exited (%s); starting another", process.pid, process.exitcode)
            time.sleep(_RESTART_PAUSE_S)
            workers.append(start())
    reserved.close()
    return exit_code
