"""Browser-test fixtures: the control plane as a real uvicorn process and Debian's Chromium driven by Playwright.

The control plane runs as its own process on a migrated SQLite file, seeded with the demo fleet
(``seed_demo``), a viewer account and demo-like telemetry (``tests/browser/demo_data.py``). It
shares this test run's Redis prefix, so a message the test sends through the channel layer
reaches the pages the browser has open.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from simulator.harness import free_port, run_checked
from tests.conftest import REDIS_URL, ROOT, ProcessGroup, migrated_sqlite

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
OPERATOR = ("operator", "operator-pass-123")
VIEWER = ("viewer", "viewer-pass-123")


@dataclass
class DashboardServer:
    """The web process under test; ``stop``/``start`` keep its port, as a restart in production would."""

    directory: Path
    env: dict[str, str]
    port: int = field(default_factory=free_port)
    group: ProcessGroup = field(init=False)

    def __post_init__(self) -> None:
        self.group = ProcessGroup(directory=self.directory, env=self.env)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        argv = [str(Path(sys.executable).parent / "uvicorn"), "controlplane.asgi:application"]
        argv += ["--host", "127.0.0.1", "--port", str(self.port), "--no-access-log"]
        self.group.start("web", argv, ready_url=f"{self.url}/login/", timeout_s=30)

    def stop(self) -> None:
        self.group.stop("web")

    def manage(self, *args: str) -> str:
        return self.run("manage.py", *args)

    def run(self, *argv: str) -> str:
        return run_checked([sys.executable, *argv], cwd=ROOT, env={**os.environ, **self.env})


@pytest.fixture(scope="session")
def chromium() -> Path:
    if not CHROMIUM.exists():
        pytest.skip(
            "Debian's chromium is not installed at /usr/bin/chromium (`make test` installs it where "
            "apt-get works): browser tests skipped"
        )
    return CHROMIUM


@pytest.fixture(scope="module")
def server(chromium: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DashboardServer]:
    plane = seeded_server(tmp_path_factory.mktemp("control-plane"))
    yield plane
    plane.group.stop_all()


def seeded_server(directory: Path, **extra_env: str) -> DashboardServer:
    """A started control plane on the demo fleet with demo telemetry (stop it with ``group.stop_all``)."""
    env = {
        "DEBUG": "true",
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
        "DATABASE_URL": f"sqlite:///{directory / 'db.sqlite3'}",
        "REDIS_URL": REDIS_URL,
        # The run's prefix (tests/settings.py): the test's channel layer reaches the server's sockets.
        "GORGO_REDIS_PREFIX": os.environ["GORGO_REDIS_PREFIX"],
        "GORGO_OPERATOR_PASSWORD": OPERATOR[1],
        "PYTHONUNBUFFERED": "1",
        **extra_env,
    }
    plane = DashboardServer(directory=directory, env=env)
    migrated_sqlite(directory / "db.sqlite3")  # what `manage.py migrate` would write
    plane.manage("seed_demo")
    plane.manage("createoperator", "--username", VIEWER[0], "--password", VIEWER[1], "--viewer")
    plane.run("-m", "tests.browser.demo_data", "--minutes", "20")
    plane.start()
    return plane


@pytest.fixture(scope="module")
def browser(chromium: Path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=str(chromium), headless=True, args=CHROMIUM_ARGS
        )
        yield launched
        launched.close()


@pytest.fixture
def artifacts() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS
