"""Stopping background tasks without ever hanging a shutdown.

redis-py's asyncio client does not reliably survive cancellation in the middle of a command (a
cancelled pipeline can leave its task pending forever; ``wait_closed`` can hang: redis/redis-py#2579,
#3941; seen here when a shutdown hit a live-state refresh). So the gateway's loops are asked to stop
(an ``asyncio.Event`` they sleep on) and given a grace period to finish their current command;
only then are they cancelled, and awaiting them is bounded: what still runs is abandoned.

Idle cost. A gateway with no traffic still runs its loops (the request log's and the prefix
index's flushes every 50 ms, the load exchange every 100 ms, probes, settles, refreshes), and
each wake-up of an idle process costs far more than the loop's own work: measured on the 2-vCPU
hosts here, 60-230 µs of CPU per timer wake-up of a bare uvloop program, so ~150 wake-ups a
second cost an idle worker ~21 ms of CPU a second. So the loops sleep on ``Flag`` (one timer
and one future a sleep, no ``asyncio.timeout`` and no exception when it runs out), and a sleep
of ``TICK_S`` or longer ends on the process's ``TICK_S`` grid of ``loop.time()`` (the nearest
point to where it would have ended), so loops whose periods are multiples of the tick wake
together: one wake-up serves them all (benchmarks/results/gateway_idle.md).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Iterable
from typing import Any

logger = logging.getLogger("routing.background")

# The grid that background sleeps of at least this long end on (see the module docstring): every
# loop period here is a multiple of it (50 ms flushes, 100 ms load exchange, 250 ms probes, ...).
TICK_S = 0.05


class Flag:
    """A stop flag for background loops: ``asyncio.Event``'s ``set``/``is_set``/``clear`` and
    ``wait``, and what ``sleep_unless`` needs to sleep on it cheaply."""

    __slots__ = ("_set", "_waiters")

    def __init__(self) -> None:
        self._set = False
        self._waiters: set[asyncio.Future[bool]] = set()

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        if self._set:
            return
        self._set = True
        waiters, self._waiters = self._waiters, set()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(True)

    def clear(self) -> None:
        self._set = False

    async def wait(self) -> bool:
        """Until the flag is set (``True``)."""
        if self._set:
            return True
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.add(waiter)
        try:
            return await waiter
        finally:
            self._waiters.discard(waiter)


def wake_at(now_s: float, seconds: float) -> float:
    """When a sleep of ``seconds`` from ``now_s`` (``loop.time()``) ends: on the ``TICK_S`` grid
    point nearest to ``now_s + seconds`` for sleeps of a tick or longer (never before ``now_s``),
    exactly then for shorter ones (backoffs, tests)."""
    if seconds < TICK_S:
        return now_s + seconds
    return max(now_s, round((now_s + seconds) / TICK_S) * TICK_S)


def _ran_out(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)


async def stop_tasks(
    tasks: Iterable[asyncio.Task[Any]], *, grace_s: float = 0.0, timeout_s: float = 2.0
) -> bool:
    """Let ``tasks`` finish for ``grace_s`` (they were asked to stop), then cancel and wait up to
    ``timeout_s``; abandon what still runs. ``False`` if some did not stop."""
    pending = {task for task in tasks if not task.done()}
    if pending and grace_s > 0:
        _, pending = await asyncio.wait(pending, timeout=grace_s)
    if not pending:
        return True
    for task in pending:
        task.cancel()
    _, still_running = await asyncio.wait(pending, timeout=timeout_s)
    for task in still_running:
        logger.warning(
            "background task %s did not stop within %.1fs; abandoning it", task.get_name(), timeout_s
        )
    return not still_running


async def sleep_unless(event: Flag, seconds: float) -> bool:
    """Sleep ``seconds`` (ending on the tick grid, ``wake_at``) or until ``event`` is set;
    ``True`` if it was set (time to stop)."""
    if event.is_set():
        return True
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[bool] = loop.create_future()
    event._waiters.add(waiter)
    timer = loop.call_at(wake_at(loop.time(), seconds), _ran_out, waiter)
    try:
        return await waiter
    finally:
        timer.cancel()
        event._waiters.discard(waiter)


async def run_bounded(awaitable: Awaitable[Any], timeout_s: float, name: str) -> bool:
    """Run ``awaitable`` for at most ``timeout_s``; ``False`` if it failed or did not finish."""
    task = asyncio.ensure_future(awaitable)
    task.set_name(name)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        await stop_tasks([task], timeout_s=0.5)
        return False
    if task.exception() is not None:
        logger.warning("%s failed: %s", name, task.exception())
        return False
    return True
