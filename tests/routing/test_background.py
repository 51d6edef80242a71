"""The background loops' sleep: stops at once when asked, ends on the shared tick grid, and loops
whose periods are multiples of the tick wake together (one wake-up of an idle gateway serves them
all; routing/background.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from routing.background import TICK_S, Flag, sleep_unless, wake_at


@pytest.mark.parametrize("now_s", [0.0, 12.3456, 1000.049, 77_777.7771])
@pytest.mark.parametrize("seconds", [TICK_S, 0.1, 0.25, 0.5, 1.0, 0.137])
def test_long_sleeps_end_on_the_nearest_grid_point(now_s: float, seconds: float) -> None:
    end = wake_at(now_s, seconds)
    assert end >= now_s
    assert abs(end / TICK_S - round(end / TICK_S)) < 1e-6  # on the grid
    assert abs(end - (now_s + seconds)) <= TICK_S / 2 + 1e-9  # the nearest point


@pytest.mark.parametrize("seconds", [0.0, 0.001, 0.01, TICK_S * 0.99])
def test_short_sleeps_are_exact(seconds: float) -> None:
    assert wake_at(5.00123, seconds) == 5.00123 + seconds


def test_a_sleep_from_a_grid_point_lasts_its_period() -> None:
    # A loop that woke on the grid (plus the moment its work took) sleeps one period, not two.
    for period in (TICK_S, 0.1, 0.25):
        woke = 40 * TICK_S + 0.003
        assert wake_at(woke, period) == pytest.approx(40 * TICK_S + period)


async def test_setting_the_flag_ends_a_sleep_at_once() -> None:
    flag = Flag()
    started = time.monotonic()
    sleeper = asyncio.create_task(sleep_unless(flag, 30.0))
    await asyncio.sleep(0.01)
    flag.set()
    assert await asyncio.wait_for(sleeper, 1.0) is True
    assert time.monotonic() - started < 1.0
    assert not flag._waiters  # nothing left behind
    assert await sleep_unless(flag, 30.0) is True  # already set: no sleep at all


async def test_a_sleep_that_runs_out_says_so_and_leaves_nothing_behind() -> None:
    flag = Flag()
    assert await sleep_unless(flag, 0.01) is False
    assert await sleep_unless(flag, TICK_S) is False
    assert not flag._waiters
    flag.set()
    flag.clear()
    assert not flag.is_set()
    assert await sleep_unless(flag, 0.01) is False


async def test_a_cancelled_sleep_leaves_nothing_behind() -> None:
    flag = Flag()
    sleeper = asyncio.create_task(sleep_unless(flag, 30.0))
    await asyncio.sleep(0.01)
    sleeper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sleeper
    assert not flag._waiters
    flag.set()  # no waiter to wake, no error


async def test_wait_returns_when_set() -> None:
    flag = Flag()
    waiter = asyncio.create_task(flag.wait())
    await asyncio.sleep(0.01)
    assert not waiter.done()
    flag.set()
    assert await asyncio.wait_for(waiter, 1.0) is True
    assert await flag.wait() is True


async def test_loops_with_multiple_periods_wake_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four loops with the gateway's periods (50, 100, 250 ms and a 50 ms one started off the
    grid): every wake-up of the slower ones is set for a wake-up of the 50 ms loop, so an idle
    process wakes once per tick, not once per loop.

    It reads the times the sleeps' timers were set for, not when they ran: on a busy machine a
    timer runs late, and the grid is about where sleeps end, not how punctual the machine is."""
    loop = asyncio.get_running_loop()
    flag = Flag()
    set_for: dict[str, list[float]] = {"50": [], "50 late": [], "100": [], "250": []}
    call_at = loop.call_at

    def spy(when: float, callback: Any, *args: Any, context: Any = None) -> asyncio.TimerHandle:
        task = asyncio.current_task()
        # the sleeps' timers only (asyncio.sleep's own, the loops' start, sets one too)
        if (
            task is not None
            and task.get_name() in set_for
            and getattr(callback, "__name__", "") == "_ran_out"
        ):
            set_for[task.get_name()].append(when)
        return call_at(when, callback, *args, context=context)

    monkeypatch.setattr(loop, "call_at", spy)

    async def run(period: float, start_after: float) -> None:
        await asyncio.sleep(start_after)
        while not await sleep_unless(flag, period):
            pass

    tasks = [
        asyncio.create_task(run(0.05, 0.0), name="50"),
        asyncio.create_task(run(0.05, 0.017), name="50 late"),
        asyncio.create_task(run(0.1, 0.031), name="100"),
        asyncio.create_task(run(0.25, 0.008), name="250"),
    ]
    await asyncio.sleep(1.0)
    flag.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 2.0)
    ticks = set(set_for["50"])
    assert len(ticks) >= 5
    for name in ("50", "50 late", "100", "250"):
        assert set_for[name], name
        for when in set_for[name]:
            assert when == round(when / TICK_S) * TICK_S, (name, when)  # on the grid
    last = max(ticks)
    for name in ("50 late", "100", "250"):
        # each set for a tick the 50 ms loop also woke at (or had yet to reach when the flag was set)
        assert all(when in ticks or when > last for when in set_for[name]), name
