"""Benchmarks that start processes, run for real in their smallest form.

``kv_cache_pressure.py`` crashed a second in (a helper it imported had changed its arguments), and
behind that its fleet sent no ``prompt_tokens_details``, so every prediction error came out empty
and the cached share 0. ``large_prompt_memory.py`` killed by ``timeout`` left its gateway running:
SIGTERM ended the script without its ``finally``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import ROOT


def test_kv_cache_pressure_measures_prediction_errors(tmp_path) -> None:
    run = subprocess.run(
        [
            sys.executable,
            "benchmarks/kv_cache_pressure.py",
            "--only",
            "pressure:precise",
            "--requests",
            "20",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    (row,) = json.loads((tmp_path / "kv_cache_pressure.json").read_text())["runs"]
    assert row["errors"] == 0 and row["requests_via_gateway"] > 0, row
    assert row["kv_events_applied"] > 0, row
    # The node's reported hits reached the gateway: errors were measured, and some prompts hit.
    assert row["prediction_error_mean"] is not None and row["cached_share"] > 0.1, row


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_killed_benchmark_stops_the_gateway_it_started(tmp_path) -> None:
    bench = subprocess.Popen(
        [sys.executable, "benchmarks/large_prompt_memory.py", "killed", "2000000"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ},
    )
    children: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not children and time.monotonic() < deadline:
            children = [
                pid for pid in _children(bench.pid) if "routing" in Path(f"/proc/{pid}/cmdline").read_text()
            ]
            time.sleep(0.2)
        assert children, "the benchmark never started its gateway"
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=30) == 143
        deadline = time.monotonic() + 15
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in children), children
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        for pid in children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
