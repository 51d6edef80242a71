"""The idle-gateway benchmark's counters: CPU and wake-ups of every thread of a process group."""

from __future__ import annotations

import subprocess
import sys
import time

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))  # the benchmarks import each other by name
import gateway_idle

from simulator.harness import stop_process_group

# A process group of two: a parent that burns ~0.3 s of CPU, then wakes 50 times a second, and a
# thread of its own that wakes 50 times a second too.
_CHILD = """
import threading, time
def tick():
    while True:
        time.sleep(0.02)
threading.Thread(target=tick, daemon=True).start()
end = time.process_time() + 0.3
while time.process_time() < end:
    pass
print("busy done", flush=True)
while True:
    time.sleep(0.02)
"""


def test_cpu_and_wakeups_count_every_thread_of_the_group() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "busy done"
        cpu_s, runs = gateway_idle.group_schedstat(child.pid)
        assert 0.25 <= cpu_s < 5.0
        time.sleep(1.0)
        cpu_after, runs_after = gateway_idle.group_schedstat(child.pid)
        # ~50 wake-ups a second from each of the two threads, counted together
        assert 60 <= runs_after - runs <= 400
        assert cpu_after - cpu_s < 0.5  # sleeping costs little
        assert gateway_idle.group_schedstat(2**22 + 12345) == (0.0, 0)  # no such group
    finally:
        stop_process_group(child)
