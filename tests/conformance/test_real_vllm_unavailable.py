"""Without vLLM the real-vLLM tests fail and say why: never a silent skip."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import real_vllm


def test_a_failed_vllm_install_is_an_error_naming_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    venv = tmp_path / "no-venv"
    monkeypatch.setenv("GORGO_VLLM_VENV", str(venv))  # scripts/ensure_vllm.py installs there...
    monkeypatch.setenv("PATH", str(tmp_path))  # ...with no python3.11 to build it: it fails at once
    monkeypatch.setattr(real_vllm, "VLLM_VENV", venv)
    monkeypatch.setattr(real_vllm, "VLLM_PYTHON", venv / "bin" / "python")
    fleet = real_vllm.RealVLLMFleet.launch(tmp_path)
    with pytest.raises(
        RuntimeError, match=r"(?s)REAL vLLM UNAVAILABLE: .*could not be installed.*python3\.11"
    ):
        fleet.wait_ready()
    assert not fleet.servers
