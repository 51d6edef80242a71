"""benchmarks/shared_limits_wan.py runs on the current front door and limiters against real Redis.

It once loaded the limiters of an older commit from git beside the current ones; once the front
door was compiled it refused those classes and the benchmark crashed before its first row.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ROOT


def test_the_benchmark_measures_each_round_trip(tmp_path) -> None:
    out = tmp_path / "slw"
    env = {**os.environ, "REDIS_URL": os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")}
    run = subprocess.run(
        [
            sys.executable,
            "benchmarks/shared_limits_wan.py",
            "--rtts",
            "0,20",
            "--requests",
            "80",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[
        -3000:
    ]  # a background loop's crash is logged, not raised
    report = json.loads(out.with_suffix(".json").read_text())
    rows = {row["shared_state_rtt_ms"]: row for row in report["runs"]}
    assert sorted(rows) == [0.0, 20.0]
    for row in rows.values():
        assert row["requests"] == 160 and row["refused"] == 0 and row["fallbacks"] == 0, row
        # Leased: far fewer Redis calls than admissions (one Lua call per admission before issue 24).
        assert row["redis_commands_per_request"] < 0.5, row
    assert rows[20.0]["requests_paying_a_round_trip"] < 80, rows[20.0]
    assert "| 20 ms |" in out.with_suffix(".md").read_text()


def test_bad_round_trips_are_refused_before_anything_runs(tmp_path) -> None:
    run = subprocess.run(
        [sys.executable, "benchmarks/shared_limits_wan.py", "--rtts", "-5", "--out", str(tmp_path / "x")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "--rtts" in run.stderr
    assert not (tmp_path / "x.json").exists()
