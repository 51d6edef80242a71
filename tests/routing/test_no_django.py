"""The gateway never imports Django (it runs without the control plane's dependencies)."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import routing

ROOT = Path(__file__).resolve().parents[2]


class TestNoDjango:
    def test_it_imports_every_routing_module_without_loading_django(self):
        modules = sorted(
            info.name
            for info in pkgutil.walk_packages(routing.__path__, "routing.")
            if info.name != "routing.__main__"
        )
        assert "routing.app" in modules and "routing.proxy" in modules
        script = (
            "import importlib, json, sys\n"
            f"for name in {modules!r} + ['routing.__main__']: importlib.import_module(name)\n"
            "print(json.dumps(sorted(m for m in sys.modules if m == 'django' or m.startswith('django.'))))\n"
        )
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}  # no DJANGO_SETTINGS_MODULE
        result = subprocess.run(
            [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout.strip().splitlines()[-1]) == []
