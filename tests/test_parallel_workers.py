"""``make test`` spreads the suite over pytest-xdist workers (scripts/run_tests.sh): each worker must
have a Redis namespace of its own, and the processes its tests start must keep the one their test
gave them.

The workers inherit the environment of the process that started them, where tests/settings.py had
already chosen a namespace: all of them shared it, so one worker's dashboard sockets received
another's pushes (a policy published elsewhere arrived where a test waited for its own message) and
their Celery workers would share one queue.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

# Two tests, one per worker: each writes what its worker sees, and what a process it starts with a
# namespace of its own (as the end-to-end tests start control planes and gateways) ends up with.
PROBE = """
import json, os, subprocess, sys, time
from pathlib import Path


def _write(name):
    time.sleep(0.5)  # both workers busy at once: one test each
    child = subprocess.run(
        [sys.executable, "-c", "import os, tests.settings; print(os.environ['GORGO_REDIS_PREFIX'])"],
        env={**os.environ, "GORGO_REDIS_PREFIX": "given-by-the-test"},
        capture_output=True, text=True, check=True, cwd=os.environ["PROBE_ROOT"],
    )
    Path(os.environ["PROBE_OUT"], name).write_text(json.dumps({
        "worker": os.environ.get("PYTEST_XDIST_WORKER"),
        "prefix": os.environ["GORGO_REDIS_PREFIX"],
        "child": child.stdout.strip(),
    }))


def test_one():
    _write("one")


def test_two():
    _write("two")
"""


def test_each_worker_has_a_namespace_and_its_processes_keep_their_own(tmp_path: Path) -> None:
    probe = tmp_path / "test_probe.py"
    probe.write_text(PROBE)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PROBE_OUT": str(out), "PROBE_ROOT": str(ROOT), "PYTHONPATH": str(ROOT)}
    env.pop("PYTEST_XDIST_WORKER", None)  # this test may itself run in a worker
    env.pop("GORGO_TEST_PREFIX_OF", None)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-n",
            "2",
            "-c",
            str(ROOT / "pyproject.toml"),
            "--rootdir",
            str(ROOT),
            str(probe),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    seen = [json.loads((out / name).read_text()) for name in ("one", "two")]
    assert {entry["worker"] for entry in seen} == {"gw0", "gw1"}
    prefixes = {entry["prefix"] for entry in seen}
    assert len(prefixes) == 2, seen  # one namespace per worker
    assert all(entry["prefix"].startswith("gorgotest-") for entry in seen)
    assert all(entry["child"] == "given-by-the-test" for entry in seen), seen
