"""The one way a test waits for a condition: poll it, with ``timeout_s`` as an upper bound only.

``wait_until`` (synchronous, from ``simulator.harness``, which the simulator's own harness uses) is
for tests that run processes or threads; ``wait_for`` is its twin for tests inside an event loop,
where a blocking sleep would stop the very server the test waits on. Neither asserts anything about
speed; a test that needs time to pass moves an injected clock instead of waiting.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from simulator.harness import wait_until

__all__ = ["wait_for", "wait_until"]


async def wait_for(
    predicate: Any, timeout_s: float = 5.0, interval_s: float = 0.02, *, what: str = ""
) -> None:
    """Poll ``predicate`` (sync or async) until true; fail after ``timeout_s`` (an upper bound only)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{what or 'condition'} not met within {timeout_s}s")
        await asyncio.sleep(interval_s)
