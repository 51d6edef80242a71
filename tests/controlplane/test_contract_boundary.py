"""The gateway side (``routing``) imports no Django: it must run without the control plane."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import routing

ROUTING_DIR = Path(routing.__file__).resolve().parent
FORBIDDEN = ("django", "rest_framework", "controlplane", "telemetry", "celery", "channels")


def routing_modules() -> list[str]:
    names = [m.name for m in pkgutil.walk_packages([str(ROUTING_DIR)], prefix="routing.")]
    return [name for name in names if not name.endswith("__main__")]


def test_it_has_no_django_import_in_the_routing_sources() -> None:
    offenders = []
    for path in ROUTING_DIR.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            offenders += [f"{path.name}: {name}" for name in names if name.split(".")[0] in FORBIDDEN]
    assert offenders == []


def test_it_loads_every_routing_module_without_django() -> None:
    modules = routing_modules()
    assert "routing.contract" in modules
    program = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        f"loaded = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})\n"
        "print(','.join(loaded))\n"
    )
    # A fresh interpreter: this test process has Django loaded already.
    result = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROUTING_DIR.parent,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""
