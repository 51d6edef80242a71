"""The gateway benchmark's paced load (``--paced-rates``): wrk's connections wait after each answer."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))  # the benchmarks import each other by name
import gateway_overhead


def test_a_paced_script_waits_after_each_answer_and_a_flat_out_one_does_not(tmp_path: Path) -> None:
    paced = gateway_overhead.wrk_script(tmp_path / "paced.lua", "k", delay_ms=15.7).read_text()
    flat = gateway_overhead.wrk_script(tmp_path / "flat.lua", "k").read_text()
    assert "function delay() return 15.7 end" in paced
    assert "delay" not in flat
    assert 'wrk.headers["Authorization"] = "Bearer k"' in paced and 'wrk.method = "POST"' in flat


def test_without_wrk_the_paced_comparison_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gateway_overhead.shutil, "which", lambda name: None)
    assert gateway_overhead.paced_workers(None, None, [1000.0], 1, 0.1) == {  # type: ignore[arg-type]
        "error": "wrk is not installed"
    }
