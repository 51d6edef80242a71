"""Probes of nodes whose circuit breaker is open: ``GET /health`` from the gateway itself.

Every ``interval_s`` the loop asks the breakers which open nodes are due, and probes each one in a
task of its own (bounded by ``timeout_s``). Any HTTP answer below 500 closes the breaker (the node
is up; what it thinks of ``/health`` is telemetry's business); no answer opens it again for longer.
So no client request is spent on finding out whether a failed node came back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp

from routing.background import sleep_unless, stop_tasks
from routing.breaker import Breakers
from routing.table import RoutingTable, node_base_url

logger = logging.getLogger("routing.breaker")


class NodeProber:
    def __init__(
        self,
        breakers: Breakers,
        session: aiohttp.ClientSession,
        table: Callable[[], RoutingTable | None],
        *,
        interval_s: float = 0.25,
        timeout_s: float = 2.0,
    ) -> None:
        self._breakers = breakers
        self._session = session
        self._table = table
        self._interval_s = interval_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._closing = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._probes: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="gorgo-node-probe")

    async def close(self) -> None:
        self._closing.set()
        await stop_tasks([t for t in (self._task, *self._probes) if t is not None], grace_s=0.5)

    async def _loop(self) -> None:
        while not await sleep_unless(self._closing, self._interval_s):
            due = self._breakers.due_probes(time.monotonic())
            if not due:
                continue
            table = self._table()
            urls = {node.id: node_base_url(node.base_url) for node in table.snapshot.nodes} if table else {}
            for node_id in due:
                url = urls.get(node_id)
                if url is None:  # the node left the fleet
                    self._breakers.success(node_id)
                    continue
                task = asyncio.create_task(self._probe(node_id, url), name=f"gorgo-probe-{node_id}")
                self._probes.add(task)
                task.add_done_callback(self._probes.discard)

    async def _probe(self, node_id: int, base_url: str) -> None:
        try:
            async with self._session.get(f"{base_url}/health", timeout=self._timeout) as response:
                alive = response.status < 500
        except (aiohttp.ClientError, TimeoutError):
            alive = False
        if alive:
            logger.info("node %s answers again; routing to it", node_id)
            self._breakers.success(node_id)
        else:
            self._breakers.failure(node_id, time.monotonic(), hard=True)
