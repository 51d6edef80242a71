"""Process and port helpers for the tests and the benchmarks (one copy; nothing here serves traffic).

Both start real processes on loopback (nodes, gateways, the control plane), wait for them to be
ready, and stop their whole process groups; this module is importable from both because the
benchmarks run as scripts and only the installed packages are on their path.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def exit_on_sigterm() -> None:
    """SIGTERM (``timeout``, ``kill <pid>``) as ``SystemExit(143)``: a benchmark's ``finally`` blocks
    then stop the processes it started instead of leaving them running without it."""
    signal.signal(signal.SIGTERM, lambda _signum, _frame: sys.exit(143))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (nothing listens on it once returned)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(
    ready: Callable[[], T],
    timeout_s: float,
    *,
    what: str = "the condition",
    interval_s: float = 0.05,
    process: subprocess.Popen | None = None,
    describe: Callable[[], str] | None = None,
) -> T:
    """Poll ``ready()`` until it returns something truthy, and return that.

    ``timeout_s`` is an upper bound only (no assertion about speed). Fails early when ``process``
    exits, and adds ``describe()`` (e.g. the processes' logs) to the error.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"exited ({process.returncode}) before {what}{_details(describe)}")
        value = ready()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not met within {timeout_s:g}s{_details(describe)}")
        time.sleep(interval_s)


def _details(describe: Callable[[], str] | None) -> str:
    return f":\n{describe()}" if describe is not None else ""


def stop_process_group(popen: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
    """Signal the process group ``popen`` leads (started with ``start_new_session=True``), wait
    until the whole group has exited, and SIGKILL what is left of it after ``timeout_s``.

    The whole group, not only its leader: a leader that exits first can leave children behind
    (vLLM's engine core outlived its API server, its KV-event connection still open, so a restart
    test saw no publisher leave)."""
    deadline = time.monotonic() + timeout_s
    with contextlib.suppress(ProcessLookupError):
        os.killpg(popen.pid, sig)
    try:
        popen.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pass
    while time.monotonic() < deadline and _group_alive(popen.pid):
        time.sleep(0.05)
    if _group_alive(popen.pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(popen.pid, signal.SIGKILL)
        if popen.poll() is None:
            popen.wait(5)


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (a zombie waiting for its reaper does not)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return any(state != "Z" for state, _, _ in group_processes(pgid))


def group_processes(pgid: int) -> list[tuple[str, int, int]]:
    """(state, user ticks, system ticks) of every process of group ``pgid``, from /proc."""
    found: list[tuple[str, int, int]] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()  # state, ppid, pgrp, ...
        except OSError:
            continue
        if int(fields[2]) == pgid:
            found.append((fields[0], int(fields[11]), int(fields[12])))
    return found


def stop_process_groups(
    popens: list[subprocess.Popen], sig: int = signal.SIGTERM, timeout_s: float = 10.0
) -> None:
    """``stop_process_group`` for many at once: signal every group first, then wait for each (one
    timeout for all), so shutdowns overlap instead of adding up."""
    running = [popen for popen in popens if popen.poll() is None]
    for popen in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(popen.pid, sig)
    deadline = time.monotonic() + timeout_s
    for popen in running:
        try:
            popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, signal.SIGKILL)
            popen.wait(5)


def run_checked(
    argv: list[str], *, cwd: str | os.PathLike, env: dict[str, str], timeout_s: float = 120
) -> str:
    """Run ``argv`` to completion and return its stdout; a failure raises with both outputs."""
    result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{result.stdout}\n{result.stderr}")
    return result.stdout
