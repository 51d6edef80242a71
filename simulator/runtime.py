"""Running the simulator's entry points on the fastest available event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


def run(main_coro: Coroutine[Any, Any, int]) -> int:
    """Run on uvloop when it is installed (faster sockets and timers), else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop ships with uvicorn[standard]
        return asyncio.run(main_coro)
    return uvloop.run(main_coro)
