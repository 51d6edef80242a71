"""The compiled hot modules (routing/native.py) decide exactly as the pure-Python ones, and the
package falls back to pure Python whenever no build matches its sources."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from routing import native

ROOT = Path(__file__).resolve().parents[2]


def _battery(pure: bool) -> dict:
    env = {**os.environ, native.PURE_ENV: "1" if pure else "0"}
    out = subprocess.run(
        [sys.executable, "-m", "tests.routing.native_battery", "25"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    return json.loads(out)


@pytest.mark.timeout(600)  # a build, when `make test` did not make one first, takes minutes on a busy machine
def test_compiled_and_pure_modules_give_the_same_decisions_and_verdicts():
    native.build()  # reused when `make test` built it already (keyed by the sources' hash)
    compiled = _battery(pure=False)
    pure = _battery(pure=True)
    assert pure["loaded"] == []  # GORGO_PURE_PYTHON=1: every module from its .py
    assert compiled["loaded"] == list(native.MODULES)  # every hot module came from the build
    assert len(compiled["decisions"]) == 1050
    assert compiled["decisions"] == pure["decisions"]
    assert compiled["verdicts"] == pure["verdicts"]
    assert len(compiled["request_path"]) == 601  # 200 header pairs, 200 in-flight views, one batch
    assert compiled["request_path"] == pure["request_path"]
    assert len(compiled["bodies"]) == 300  # parse_body: parsed requests and client errors
    assert compiled["bodies"] == pure["bodies"]


def test_a_build_is_used_only_while_its_sources_are_unchanged(tmp_path, monkeypatch):
    source = tmp_path / "routing" / "hot.py"
    source.parent.mkdir()
    source.write_text("X = 1\n")
    monkeypatch.setattr(native, "_SOURCE_ROOT", tmp_path)
    monkeypatch.setattr(native, "_BUILDS", tmp_path / "var" / "mypyc")
    build = tmp_path / "var" / "mypyc" / "0123456789abcdef"
    build.mkdir(parents=True)
    manifest = {
        "cache_tag": sys.implementation.cache_tag,
        "modules": list(native.MODULES),
        "sources": native._file_digests([source]),
    }
    (build / "manifest.json").write_text(json.dumps(manifest))
    assert native.current_build() == build
    source.write_text("X = 2\n")  # edited since the build: pure Python until rebuilt
    assert native.current_build() is None
    source.unlink()
    assert native.current_build() is None


@pytest.mark.timeout(600)
def test_no_build_or_pure_python_leaves_the_source_modules(tmp_path, monkeypatch):
    native.build()
    monkeypatch.delenv(native.PURE_ENV, raising=False)
    assert native.compiled_finder() is not None  # the current build, found
    for flag in ("1", "yes"):
        monkeypatch.setenv(native.PURE_ENV, flag)
        assert native.compiled_finder() is None
    monkeypatch.setenv(native.PURE_ENV, "0")
    assert native.compiled_finder() is not None
    monkeypatch.setattr(native, "_BUILDS", tmp_path / "nothing-here")
    assert native.compiled_finder() is None
    monkeypatch.setenv(native.PURE_ENV, "maybe")
    with pytest.raises(ValueError, match="GORGO_PURE_PYTHON"):
        native.compiled_finder()
