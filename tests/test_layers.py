"""Imports point one way: core <- fleet <- policies (and keys) <- telemetry <- dashboard.

Every module of the control plane, telemetry, the gateway and the simulator is parsed (``ast``, so
imports inside functions count as much as those at the top, and nothing is executed), each import
is placed in its layer, and an import that points the wrong way fails the test with its line. The
migrations' ``dependencies`` and ``run_before`` are checked the same way, by app label. The layers
are the ones docs/controlplane.md ("Layers") and ARCHITECTURE.md describe.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("controlplane", "telemetry", "routing", "simulator")

# The project wiring at the top: it mounts every app's URLs and consumers.
ROOTS = {"controlplane.urls", "controlplane.asgi"}
APP_LAYERS = {
    "controlplane.fleet": "fleet",
    "controlplane.policies": "policies",
    "controlplane.keys": "keys",
    "controlplane.dashboard": "dashboard",
    "controlplane.demo": "demo",
    "telemetry": "telemetry",
    "routing": "routing",
    "simulator": "simulator",
    "tests": "tests",
    "benchmarks": "benchmarks",
}
# Which layers each layer may import (its own always). ``routing`` is the Django-free gateway and
# its contract: everyone may use it, it uses no one. ``demo`` (``seed_demo``) is development-only:
# the one place the control plane may read the simulator's topology.
ALLOWED = {
    "core": {"routing"},
    "fleet": {"core", "routing"},
    "policies": {"core", "fleet", "routing"},
    "keys": {"core", "fleet", "routing"},
    # Telemetry sits above policies but needs nothing of them (it measures the fleet); keeping it
    # off policies is what broke the telemetry <-> control plane cycle.
    "telemetry": {"core", "fleet", "keys", "routing"},
    "dashboard": {"core", "fleet", "policies", "keys", "telemetry", "routing"},
    "demo": {"core", "fleet", "policies", "routing", "simulator"},
    "root": {"core", "fleet", "policies", "keys", "telemetry", "dashboard", "routing"},
    "routing": set(),
    "simulator": {"routing"},
}
OURS = {"controlplane", "telemetry", "routing", "simulator", "tests", "benchmarks"}
# Of the gateway, the control plane (and telemetry, the dashboard) may import only its face: the
# contract (wire structs, keys), the one snapshot writer, and the two helpers every gorgo process
# shares (URL masking in logs, the spelling of environment values). Everything else in ``routing``
# is the gateway's own, free to move without the control plane noticing.
ROUTING_FACE = {"routing.contract", "routing.writer", "routing.redact", "routing.env"}
CONTROL_PLANE = {"core", "fleet", "policies", "keys", "telemetry", "dashboard", "demo", "root"}
# Migration dependencies name apps by label.
LABEL_LAYERS = {label: label for label in ("fleet", "policies", "keys", "telemetry", "dashboard", "demo")}


def layer_of(module: str) -> str:
    if module in ROOTS:
        return "root"
    for prefix, layer in APP_LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            return layer
    if module == "controlplane" or module.startswith("controlplane."):
        return "core"  # the project package's own top-level modules
    raise ValueError(f"{module} is in no layer")


@dataclass(frozen=True)
class Violation:
    module: str
    line: int
    target: str
    why: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line} imports {self.target} ({self.why})"


def _imported(module: str, is_package: bool, tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import anywhere in the tree, relative ones resolved."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            # ``from controlplane import audit`` imports the module controlplane.audit (and
            # ``from routing import contract`` the module routing.contract).
            for alias in node.names:
                yield node.lineno, f"{name}.{alias.name}" if name in {"controlplane", "routing"} else name


def _migration_labels(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, app label) of each ``dependencies`` / ``run_before`` entry of a Migration class."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id in {"dependencies", "run_before"} for t in node.targets
        ):
            for element in getattr(node.value, "elts", []):
                if isinstance(element, ast.Tuple) and isinstance(element.elts[0], ast.Constant):
                    yield element.lineno, element.elts[0].value


def violations(module: str, source: str, *, is_package: bool = False) -> list[Violation]:
    """Every import (and migration dependency) of ``module`` that points the wrong way."""
    tree = ast.parse(source)
    own = layer_of(module)
    found = []
    for line, target in sorted(set(_imported(module, is_package, tree))):
        if target.split(".")[0] not in OURS:
            continue  # the standard library and third-party packages
        other = layer_of(target)
        if other != own and other not in ALLOWED[own]:
            found.append(Violation(module, line, target, f"{own} may not import {other}"))
        elif other == "routing" and own in CONTROL_PLANE and target not in ROUTING_FACE:
            found.append(Violation(module, line, target, f"{own} may import only the gateway's face"))
    if ".migrations." in module:
        for line, label in _migration_labels(tree):
            other = LABEL_LAYERS.get(label)
            if other is not None and other != own and other not in ALLOWED[own]:
                found.append(
                    Violation(module, line, f"migrations of {label}", f"{own} may not depend on {other}")
                )
    return found


def modules() -> Iterator[tuple[str, Path, bool]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            yield ".".join(parts[:-1] if is_package else parts), path, is_package


def test_every_import_points_down_the_layers() -> None:
    found = [
        str(v)
        for module, path, is_package in modules()
        for v in violations(module, path.read_text(), is_package=is_package)
    ]
    assert found == []


def test_it_knows_the_layer_of_every_module() -> None:
    assert {layer_of(module) for module, _, _ in modules()} >= {
        "core",
        "fleet",
        "policies",
        "telemetry",
        "dashboard",
        "routing",
        "simulator",
        "root",
    }


@pytest.mark.parametrize(
    ("module", "source", "target"),
    [
        # What the tree had before the re-layering, each one caught:
        (
            "telemetry.tasks",
            "from controlplane.policies.publishing import redis_client\n",
            "policies.publishing",
        ),
        (
            "controlplane.fleet.signals",
            "def run():\n    from controlplane.policies.publishing import republish_active\n",
            "policies.publishing",
        ),
        (
            "controlplane.api",
            "def f():\n    from controlplane.policies.deletion import x\n",
            "policies.deletion",
        ),
        ("controlplane.policies.management.commands.seed_demo", "import simulator.topology\n", "simulator"),
        ("telemetry.views", "from controlplane.dashboard import series\n", "dashboard"),
        ("controlplane.keys.models", "from controlplane.policies.models import RoutingPolicy\n", "policies"),
        ("controlplane.policies.models", "from controlplane.keys import models\n", "keys"),
        ("routing.app", "import django\nfrom controlplane import settings\n", "controlplane.settings"),
        ("controlplane.audit", "from . import fleet\n", "controlplane.fleet"),
        ("controlplane.audit", "from .fleet import models\n", "controlplane.fleet"),
        ("controlplane.fleet.admin", "from ..policies import deletion\n", "controlplane.policies"),
        ("telemetry.live", "from tests.conftest import free_port\n", "tests"),
        # The control plane reaching past the gateway's face (issue 21):
        ("controlplane.policies.choices", "from routing.algorithms import REGISTRY\n", "routing.algorithms"),
        (
            "controlplane.policies.checks",
            "from routing.algorithms.base import AlgorithmInfo\n",
            "routing.algorithms",
        ),
        ("telemetry.tasks", "from routing import proxy\n", "routing.proxy"),
        ("controlplane.dashboard.views", "def f():\n    import routing.state.table\n", "routing.state"),
    ],
)
def test_it_catches_an_import_pointing_the_wrong_way(module: str, source: str, target: str) -> None:
    (violation,) = violations(module, source)
    assert target in violation.target


def test_it_catches_a_migration_depending_on_a_higher_layer() -> None:
    source = (
        "class Migration:\n    dependencies = [('fleet', '0001_initial'), ('policies', '0001_initial')]\n"
    )
    (violation,) = violations("controlplane.fleet.migrations.0002_operator_and_viewer_groups", source)
    assert violation.target == "migrations of policies"


def test_it_lets_a_layer_import_below_itself() -> None:
    source = (
        "from controlplane import audit, connections\n"
        "from controlplane.fleet.models import Node\n"
        "from routing.contract import RedisKeys\n"
        "from routing import contract, writer\n"
        "def f():\n    from controlplane.keys.models import ClientKey\n"
    )
    assert violations("telemetry.tasks", source) == []
    assert violations("controlplane.dashboard.views", "from controlplane.policies import publishing\n") == []
    assert violations("controlplane.demo.management.commands.seed_demo", "import simulator.topology\n") == []
