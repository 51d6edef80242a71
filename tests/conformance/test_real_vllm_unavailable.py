"""Without vLLM the real-vLLM tests fail and say why: never a silent skip."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import real_vllm


def test_a_missing_vllm_install_is_an_error_naming_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(real_vllm, "VLLM_VENV", tmp_path / "no-venv")
    monkeypatch.setattr(real_vllm, "VLLM_PYTHON", tmp_path / "no-venv" / "bin" / "python")
    fleet = real_vllm.RealVLLMFleet.launch(tmp_path)
    assert not fleet.servers
    with pytest.raises(RuntimeError, match=r"REAL vLLM UNAVAILABLE: .*scripts/ensure_vllm\.py"):
        fleet.wait_ready()
