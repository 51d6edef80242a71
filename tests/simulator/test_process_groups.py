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


def test_stopping_a_group_stops_the_children_its_leader_left_behind(tmp_path) -> None:
    """vLLM's engine core could outlive its API server: the stop returned once the leader was gone,
    and the child (here one that ignores SIGTERM) went on running, its connections open."""
    import contextlib
    import os
    import signal
    import subprocess
    import sys
    import time

    from simulator.harness import stop_process_group

    child_pid = tmp_path / "child.pid"
    child = (  # ignores SIGTERM, then says so by writing its pid
        "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"open({str(child_pid)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    )
    leader = (
        f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(60)"
    )
    popen = subprocess.Popen([sys.executable, "-c", leader], start_new_session=True)
    deadline = time.monotonic() + 10
    while not child_pid.exists() or not child_pid.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    pid = int(child_pid.read_text())
    try:
        stop_process_group(popen, signal.SIGTERM, timeout_s=1.0)
        time.sleep(0.2)  # init reaps it
        try:
            with open(f"/proc/{pid}/stat") as stat:
                state = stat.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            state = "gone"
        assert state in ("gone", "Z"), state  # not left running
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # never leave it behind, whatever the outcome
