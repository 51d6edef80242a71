"""Probes of nodes from the gateway itself: ``GET /health``, bounded by ``timeout_s``.

- Nodes whose circuit breaker is open: every ``interval_s`` the loop asks the breakers which are
  due and probes each in a task of its own. Any HTTP answer below 500 closes the breaker (the node
  is up; what it thinks of ``/health`` is telemetry's business); no answer opens it again for
  longer. So no client request is spent on finding out whether a failed node came back.
- Telemetry's word as a hint: a node the live state marked unhealthy and then healthy again (its
  health check found it answering) is back, and its open breaker is probed at the next tick, not
  when its doubling wait ends (up to ``breaker_max_open_s``, a minute by the end of a long
  outage). Without it a region's gateways kept its clients abroad ~2.4 s after its nodes came
  back (region-outage, 2026-11-26). A healthy entry alone is no news (it may predate the
  failure); only the flip counts, once per flip. The probe still decides.
- Suspects (``HungWatch``): a non-streaming request's node answers only when the whole completion
  is done, so silence proves nothing by itself. After the first-byte timeout the gateway asks the
  node's ``/health``; a node that does not answer that either is hung: the request is taken back
  (nothing reached the client yet) and sent elsewhere, and the node's breaker opens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from routing.background import Flag, sleep_unless, stop_tasks
from routing.contract import NodeLiveState
from routing.deadlines import Deadline, FixedDelay
from routing.http.upstream import UpstreamClient, UpstreamError, make_target
from routing.resilience.breaker import Breakers
from routing.state.table import RoutingTable

logger = logging.getLogger("routing.breaker")


class NodeProber:
    def __init__(
        self,
        breakers: Breakers,
        client: UpstreamClient,
        table: Callable[[], RoutingTable | None],
        *,
        interval_s: float = 0.25,
        timeout_s: float = 2.0,
    ) -> None:
        self._breakers = breakers
        self._client = client
        self._table = table
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._closing = Flag()
        self._task: asyncio.Task[None] | None = None
        self._probes: set[asyncio.Task[None]] = set()
        self._suspects: dict[int, asyncio.Future[bool]] = {}
        self.down_in_telemetry: set[int] = set()  # nodes whose live entry says unhealthy
        self._live_seen: object = None  # the live mapping last followed (tables share it until it changes)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="gorgo-node-probe")

    async def close(self) -> None:
        self._closing.set()
        tasks = [t for t in (self._task, *self._probes, *self._suspects.values()) if t is not None]
        await stop_tasks(tasks, grace_s=0.5)  # type: ignore[arg-type]

    async def _loop(self) -> None:
        while not await sleep_unless(self._closing, self._interval_s):
            now_s = time.monotonic()
            table = self._table()
            if table is not None:
                self.follow_live(table.live, now_s)
            due = self._breakers.due_probes(now_s)
            if not due:
                continue
            urls = table.base_urls if table is not None else {}
            for node_id in due:
                url = urls.get(node_id)
                if url is None:  # the node left the fleet
                    self._breakers.success(node_id)
                    continue
                task = asyncio.create_task(self._probe(node_id, url), name=f"gorgo-probe-{node_id}")
                self._probes.add(task)
                task.add_done_callback(self._probes.discard)

    def follow_live(self, live: Mapping[int, NodeLiveState], now_s: float) -> None:
        """Nodes the live state saw go down and come back: hurry their probe (if their breaker is open).

        A node without an entry (none yet, or gone stale) keeps what was last known of it.
        """
        if live is self._live_seen:
            return
        self._live_seen = live
        down = self.down_in_telemetry
        for node_id, entry in live.items():
            if not entry.healthy:
                down.add(node_id)
            elif node_id in down:
                down.discard(node_id)
                self._breakers.recovered(node_id, now_s)

    async def _answers(self, base_url: str) -> bool:
        try:
            target = make_target(f"{base_url}/health", "GET")
            async with asyncio.timeout(self._timeout_s):
                response = await self._client.request(target, b"")
                try:
                    await response.read()
                finally:
                    response.close()
            return response.status < 500
        except (UpstreamError, TimeoutError, ValueError):
            return False

    def alive(self, node_id: int, base_url: str) -> asyncio.Future[bool]:
        """Whether the node answers ``/health``; one probe per node at a time, shared by callers."""
        probe = self._suspects.get(node_id)
        if probe is None or probe.done():
            probe = self._suspects[node_id] = asyncio.ensure_future(self._answers(base_url))
        return probe

    async def _probe(self, node_id: int, base_url: str) -> None:
        alive = await self._answers(base_url)
        if alive:
            logger.info("node %s answers again; routing to it", node_id)
            self._breakers.success(node_id)
        else:
            self._breakers.failure(node_id, time.monotonic(), hard=True)


class HungWatch:
    """Takes a request back from a node that stopped answering even ``/health`` before its first
    byte: a non-streaming request's head, a stream's first event (its head comes at once).

    Armed when the request is sent: a timer (no task; one of ``timers``, the first-byte timeout)
    that then asks the prober
    whether the node is alive; if not, it marks itself ``hung`` and cancels the request's task,
    which catches the cancellation and retries elsewhere. ``stop`` disarms it.
    """

    __slots__ = ("_probe", "_prober", "_task", "_timer", "base_url", "hung", "node_id")

    def __init__(
        self,
        prober: NodeProber,
        task: asyncio.Task[object],
        node_id: int,
        base_url: str,
        timers: FixedDelay,
        loop: asyncio.AbstractEventLoop,  # the task's (given: not looked up per request)
    ) -> None:
        self._prober = prober
        self._task = task
        self.node_id = node_id
        self.base_url = base_url
        self.hung = False
        self._probe: asyncio.Future[bool] | None = None
        self._timer: Deadline | None = timers.call(loop, self._suspect)

    def _suspect(self) -> None:
        self._timer = None
        if self._task.done():
            return
        self._probe = self._prober.alive(self.node_id, self.base_url)
        self._probe.add_done_callback(self._verdict)

    def _verdict(self, probe: asyncio.Future[bool]) -> None:
        if self._probe is None or probe.cancelled() or probe.result():
            return
        self.hung = True
        self._task.cancel()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._probe is not None:
            self._probe.remove_done_callback(self._verdict)
            self._probe = None
