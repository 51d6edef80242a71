"""An event loop's clock for tests: timers that fire when the test moves the time, not before.

What the gateway's timer code asks of a loop (``time``, ``call_at``, ``call_soon``); production
passes the running loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class ManualTimer:
    """A loop timer handle: when it is due, and whether it was cancelled."""

    def __init__(self, when_s: float, callback: Callable[[], Any]) -> None:
        self.when_s = when_s
        self.callback = callback
        self.cancelled = False

    def when(self) -> float:
        return self.when_s

    def cancel(self) -> None:
        self.cancelled = True


class ManualLoop:
    """What the protocol asks of its loop, on a clock the test moves."""

    def __init__(self) -> None:
        self.now_s = 1000.0
        self.timers: list[ManualTimer] = []
        self.ready: list[Callable[[], Any]] = []

    def time(self) -> float:
        return self.now_s

    def call_at(self, when_s: float, callback: Callable[[], Any]) -> ManualTimer:
        timer = ManualTimer(when_s, callback)
        self.timers.append(timer)
        return timer

    def call_soon(self, callback: Callable[..., Any], *args: Any) -> None:
        self.ready.append(lambda: callback(*args))

    def advance(self, seconds: float) -> None:
        """Move the clock, running what falls due on the way, in order."""
        self.now_s += seconds
        self.run_ready()
        while due := sorted(
            (t for t in self.timers if t.when_s <= self.now_s and not t.cancelled), key=lambda t: t.when_s
        ):
            self.timers.remove(due[0])
            due[0].callback()
            self.run_ready()

    def run_ready(self) -> None:
        while self.ready:
            self.ready.pop(0)()
