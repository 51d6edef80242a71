"""Every benchmark script answers ``--help`` with its usage and runs nothing.

A script that read ``sys.argv`` by hand ran the whole benchmark on ``--help`` and overwrote its
committed results; ``routing_quality.py --help`` crashed on a ``%`` in a help string.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT

SCRIPTS = sorted(
    path
    for path in (ROOT / "benchmarks").glob("*.py")
    if 'if __name__ == "__main__":' in path.read_text(encoding="utf-8")
)
RESULTS = ROOT / "benchmarks" / "results"


def _results_state() -> dict[str, int]:
    return {str(path): path.stat().st_mtime_ns for path in RESULTS.rglob("*") if path.is_file()}


def test_the_scripts_are_found() -> None:
    assert len(SCRIPTS) >= 10, SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_a_benchmark_answers_help_without_running(script) -> None:
    before = _results_state()
    answer = subprocess.run(
        [sys.executable, str(script), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert answer.returncode == 0, answer.stderr[-2000:]
    assert answer.stdout.startswith("usage:"), answer.stdout[:500]
    assert _results_state() == before  # nothing measured, nothing written
