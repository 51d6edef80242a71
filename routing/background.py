"""Stopping background tasks without ever hanging a shutdown.

redis-py's asyncio client does not reliably survive cancellation in the middle of a command (a
cancelled pipeline can leave its task pending forever; ``wait_closed`` can hang: redis/redis-py#2579,
#3941; seen here when a shutdown hit a live-state refresh). So the gateway's loops are asked to stop
(an ``asyncio.Event`` they sleep on) and given a grace period to finish their current command;
only then are they cancelled, and awaiting them is bounded: what still runs is abandoned.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Iterable
from typing import Any

logger = logging.getLogger("routing.background")


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


async def sleep_unless(event: asyncio.Event, seconds: float) -> bool:
    """Sleep ``seconds`` or until ``event`` is set; ``True`` if it was set (time to stop)."""
    if event.is_set():
        return True
    try:
        async with asyncio.timeout(seconds):
            await event.wait()
    except TimeoutError:
        return False
    return True


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
