"""The gateway's hot modules compiled with mypyc, with the pure-Python modules as the fallback.

``scripts/build_native.py`` (``build()``) compiles ``MODULES`` (typed, pure, called per request: the
routing algorithms and the front door's per-request checks) into ``var/mypyc/<source hash>/``,
beside the sources, never over them: the ``.py`` files stay what runs whenever no build matches.
``make run`` and ``make test`` call it; a build whose sources are unchanged is reused (the hash
covers the compiled modules, the ``routing`` modules they import, mypy's and Python's versions).

``install()`` (called by ``routing/__init__.py``, before any submodule is imported) puts a finder
in front of ``sys.meta_path`` that loads the compiled extension for those module names when a build
for the current sources exists. Anything else (no build, stale sources, no compiler, or
``GORGO_PURE_PYTHON=1``) leaves the pure-Python modules in place, so the package always works
uncompiled. ``loaded()`` says which modules came from the build.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from routing.env import parse_bool

# Typed, free of I/O, and on every request's path (measured in benchmarks/native_speed.py).
MODULES = (
    "routing.algorithms.base",
    "routing.algorithms.gorgo",
    "routing.algorithms.least_load",
    "routing.algorithms.prefix_affinity",
    "routing.algorithms.round_robin",
    "routing.algorithms.session_affinity",
    "routing.cache.approx_index",
    "routing.cache.kv_aware_index",
    "routing.cache.parsed",
    "routing.cache.prompt",
    "routing.cache.token_ratio",
    "routing.deadlines",
    "routing.frontdoor.admission",
    "routing.frontdoor.auth",
    "routing.frontdoor.concurrency",
    "routing.frontdoor.front_door",
    "routing.frontdoor.ratelimit",
    "routing.http.client_side",
    "routing.http.headers",
    "routing.http.upstream",
    "routing.http.usage_read",
    "routing.observability.exporter",
    "routing.observability.request_log",
    "routing.proxy.exchange",
    "routing.proxy.handler",
    "routing.proxy.outcome",
    "routing.proxy.relay",
    "routing.proxy.shadow",
    "routing.resilience.breaker",
    "routing.resilience.node_probe",
    "routing.resilience.retry",
    "routing.state.homing",
    "routing.state.inflight",
    "routing.state.measured",
    "routing.state.table",
)
GROUP = "gorgo_native"  # the shared library's name: gorgo_native__mypyc
PURE_ENV = "GORGO_PURE_PYTHON"
_MANIFEST = "manifest.json"

_SOURCE_ROOT = Path(__file__).resolve().parent.parent  # the checkout: routing/ and var/ live here
_BUILDS = _SOURCE_ROOT / "var" / "mypyc"
_installed: list[Path] = []  # the build the finder loads from, once installed


def _source_path(module: str) -> Path:
    return _SOURCE_ROOT.joinpath(*module.split(".")).with_suffix(".py")


def _hashed_sources() -> list[Path]:
    """The compiled modules and the ``routing`` modules they import: mypyc bakes in what it knows
    of those (``Final`` constants, class layouts), so a change to either invalidates a build."""
    paths = {_source_path(module) for module in MODULES}
    for module in MODULES:
        tree = ast.parse(_source_path(module).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("routing"):
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names if alias.name.startswith("routing")]
            else:
                continue
            for name in names:
                path = _source_path(name)
                if path.is_file():
                    paths.add(path)
                elif (path.with_suffix("") / "__init__.py").is_file():
                    paths.add(path.with_suffix("") / "__init__.py")
    return sorted(paths)


def _digest(paths: Sequence[Path], mypy_version: str) -> str:
    digest = hashlib.sha256(f"{sys.implementation.cache_tag} {mypy_version} {MODULES}".encode())
    for path in paths:
        digest.update(str(path.relative_to(_SOURCE_ROOT)).encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:16]


def _file_digests(paths: Sequence[Path]) -> dict[str, str]:
    return {str(p.relative_to(_SOURCE_ROOT)): hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


# ---- loading ------------------------------------------------------------------------------------


class _CompiledFinder(importlib.abc.MetaPathFinder):
    """Finds the compiled extension of each module in a build (and the group's shared library)."""

    def __init__(self, build: Path, files: dict[str, Path]) -> None:
        self.build = build
        self._files = files

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        file = self._files.get(fullname)
        if file is None:
            return None
        loader = importlib.machinery.ExtensionFileLoader(fullname, str(file))
        return importlib.util.spec_from_file_location(fullname, file, loader=loader)


def current_build() -> Path | None:
    """The build of the current sources, if there is one (the manifest's file hashes all match)."""
    try:
        builds = list(_BUILDS.iterdir())
    except OSError:
        return None
    for build in builds:
        try:
            manifest = json.loads((build / _MANIFEST).read_text())
            if manifest["cache_tag"] != sys.implementation.cache_tag or manifest["modules"] != list(MODULES):
                continue
            sources = [_SOURCE_ROOT / name for name in manifest["sources"]]
            if _file_digests(sources) == manifest["sources"]:
                return build
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def pure_python_requested() -> bool:
    """``GORGO_PURE_PYTHON`` (unset or empty: no), spelled as every gorgo boolean (routing/env.py)."""
    raw = os.environ.get(PURE_ENV, "")
    if not raw.strip():
        return False
    try:
        return parse_bool(raw)
    except ValueError as exc:
        raise ValueError(f"{PURE_ENV}: {exc}") from None


def compiled_finder() -> _CompiledFinder | None:
    """The finder of the current build's modules; None under ``GORGO_PURE_PYTHON=1`` or with no
    complete build of the current sources."""
    if pure_python_requested():
        return None
    build = current_build()
    if build is None:
        return None
    files: dict[str, Path] = {}
    for file in build.rglob(f"*{importlib.machinery.EXTENSION_SUFFIXES[0]}"):
        relative = file.relative_to(build)
        name = ".".join((*relative.parts[:-1], relative.name.split(".", 1)[0]))
        files[name] = file
    if not all(module in files for module in MODULES):
        return None
    return _CompiledFinder(build, files)


def install() -> None:
    """Load the compiled modules from the current build, if ``compiled_finder`` finds one."""
    if _installed:
        return
    finder = compiled_finder()
    if finder is not None:
        sys.meta_path.insert(0, finder)
        _installed.append(finder.build)


def loaded() -> list[str]:
    """The modules of ``MODULES`` imported from the compiled build in this process (empty: pure
    Python). Read from the modules' files: the group's shared library initialises the modules it
    imports itself, past the finder."""
    if not _installed:
        return []
    build = str(_installed[0])
    return [
        name
        for name in MODULES
        if name in sys.modules and str(getattr(sys.modules[name], "__file__", "")).startswith(build)
    ]


# ---- building -----------------------------------------------------------------------------------


def build(quiet: bool = True) -> Path:
    """Compile ``MODULES`` into ``var/mypyc/<hash>/`` unless that build exists; return its folder."""
    sources = _hashed_sources()
    target = _BUILDS / _digest(sources, importlib.metadata.version("mypy"))
    if (target / _MANIFEST).is_file():
        return target
    from mypyc.build import mypycify  # only a build needs mypyc (and it takes a second to import)
    from setuptools import Distribution

    _BUILDS.mkdir(parents=True, exist_ok=True)
    for stale in _BUILDS.iterdir():  # one build at a time: the old ones are dead weight
        shutil.rmtree(stale, ignore_errors=True)
    work = Path(tempfile.mkdtemp(prefix="build-", dir=_BUILDS.parent))
    cwd = os.getcwd()
    try:
        os.chdir(_SOURCE_ROOT)  # mypyc names the modules by their paths from here
        extensions = mypycify(
            [str(_source_path(module).relative_to(_SOURCE_ROOT)) for module in MODULES]
            + [
                "--ignore-missing-imports",
                "--follow-imports=silent",
                f"--cache-dir={_BUILDS.parent / 'mypy-cache'}",
            ],
            opt_level="3",
            target_dir=str(work / "c"),
            group_name=GROUP,
            verbose=not quiet,
        )
        distribution = Distribution({"name": "gorgo-native", "ext_modules": extensions})
        command = distribution.get_command_obj("build_ext")
        command.build_lib = str(work / "lib")  # type: ignore[attr-defined]
        command.build_temp = str(work / "tmp")  # type: ignore[attr-defined]
        command.inplace = False  # type: ignore[attr-defined]
        if quiet:
            distribution.verbose = False
        distribution.run_command("build_ext")
        manifest = {
            "cache_tag": sys.implementation.cache_tag,
            "modules": list(MODULES),
            "sources": _file_digests(sources),
        }
        (work / "lib" / _MANIFEST).write_text(json.dumps(manifest, indent=1))
        os.replace(work / "lib", target)  # whole or not at all: a half build is never loaded
    finally:
        os.chdir(cwd)
        shutil.rmtree(work, ignore_errors=True)
    return target
