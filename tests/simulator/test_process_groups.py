"""``simulator.harness.stop_process_groups``: many process groups stopped at once, stragglers killed."""

from __future__ import annotations

import subprocess
import sys

from simulator.harness import stop_process_groups

# A parent that ignores SIGTERM, with a child in its group: only SIGKILL stops them.
STUBBORN = (
    "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); print('up', flush=True); "
    "time.sleep(60)"
)


def _start(code: str) -> subprocess.Popen[bytes]:
    popen = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    assert popen.stdout is not None and popen.stdout.readline() == b"up\n"
    return popen


def test_it_stops_every_group_and_kills_the_one_that_ignores_sigterm() -> None:
    polite = [_start("import time; print('up', flush=True); time.sleep(60)") for _ in range(3)]
    stubborn = _start(STUBBORN)
    done = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    done.wait(10)  # already gone: skipped, no error
    stop_process_groups([*polite, stubborn, done], timeout_s=1.0)
    assert all(popen.poll() is not None for popen in [*polite, stubborn])
    assert stubborn.returncode == -9  # SIGKILL, after the timeout
    assert all(popen.returncode == -15 for popen in polite)  # SIGTERM
