"""Fixtures every part of the suite shares: Redis, free ports, and real processes on loopback."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis

from routing.contract import RedisKeys
from simulator.harness import free_port, run_checked, stop_process_group, wait_until
from tests.real_vllm import BOOT_TIMEOUT_S, INSTALL_TIMEOUT_S, RealVLLMFleet

ROOT = Path(__file__).resolve().parent.parent
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")


def delete_namespace(client: redis.Redis, prefix: str) -> None:
    for key in client.scan_iter(match=f"{prefix}:*", count=500):
        client.delete(key)


@pytest.fixture(scope="session")
def redis_url() -> str:
    return REDIS_URL


@pytest.fixture(scope="session", autouse=True)
def _session_namespace_cleanup() -> Iterator[None]:
    """Delete this run's Redis namespace (from tests/settings.py) when the session ends."""
    yield
    prefix = os.environ.get("GORGO_REDIS_PREFIX", "")
    if prefix.startswith("gorgotest-"):
        try:
            delete_namespace(redis.Redis.from_url(REDIS_URL), prefix)
        except redis.RedisError:
            pass


@pytest.fixture
def redis_keys(redis_url: str) -> Iterator[RedisKeys]:
    """A Redis namespace of the test's own, deleted afterwards."""
    keys = RedisKeys(prefix=f"gorgotest-{uuid.uuid4().hex}")
    yield keys
    delete_namespace(redis.Redis.from_url(redis_url), keys.prefix)


@dataclass
class Process:
    """A process the test started; its output goes to a log file shown when a test fails."""

    name: str
    popen: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.popen.poll() is None


@dataclass
class ProcessGroup:
    """Starts real processes for a test and stops every one of them afterwards."""

    directory: Path
    env: dict[str, str] = field(default_factory=dict)
    processes: dict[str, Process] = field(default_factory=dict)

    def start(
        self,
        name: str,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        ready_url: str | None = None,
        ready_text: str | None = None,
        timeout_s: float = 30.0,
    ) -> Process:
        """Start ``argv`` and wait until ``ready_url`` answers 2xx or ``ready_text`` is in its log."""
        log_path = self.directory / f"{name}.log"
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env, **(env or {})}
        with log_path.open("wb") as log_file:  # the child keeps its own copy of the descriptor
            popen = subprocess.Popen(
                argv,
                cwd=ROOT,
                env=full_env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        process = Process(name=name, popen=popen, log_path=log_path)
        self.processes[name] = process
        if ready_url or ready_text:
            wait_until(
                lambda: (
                    (ready_text is not None and ready_text in process.log())
                    or (ready_url is not None and _answers(ready_url))
                ),
                timeout_s,
                what=f"{name} ready",
                interval_s=0.1,
                process=popen,
                describe=lambda: process.log()[-4000:],
            )
        return process

    def stop(self, name: str, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
        stop_process_group(self.processes.pop(name).popen, sig, timeout_s)

    def stop_all(self) -> None:
        for name in list(self.processes):
            self.stop(name)

    def logs(self) -> str:
        return "\n".join(f"----- {p.name} -----\n{p.log()[-3000:]}" for p in self.processes.values())


def start_celery(processes: ProcessGroup, prefix: str, env: dict[str, str], concurrency: int) -> None:
    """A Celery worker (threads, on the run's own default queue) and beat, as real processes."""
    celery = [sys.executable, "-m", "celery", "-A", "controlplane"]
    env = {**env, "CELERY_TASK_DEFAULT_QUEUE": f"{prefix}.default"}
    processes.start(
        "worker",
        [
            *celery,
            "worker",
            "-Q",
            f"{prefix}.default",
            "--pool=threads",
            f"--concurrency={concurrency}",
            "-n",
            f"{prefix}@%h",
            "--without-gossip",
            "--without-mingle",
            "--loglevel=INFO",
        ],
        env=env,
        ready_text="ready.",
        timeout_s=60,
    )
    processes.start(
        "beat",
        [*celery, "beat", "-s", str(processes.directory / "beat-schedule"), "--loglevel=INFO"],
        env=env,
        ready_text="Starting",
    )


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).is_success
    except httpx.HTTPError:
        return False


@pytest.fixture
def processes(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[ProcessGroup]:
    """Real processes for this test, stopped afterwards; their logs are printed if the test failed."""
    group = ProcessGroup(directory=tmp_path)
    yield group
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        sys.stderr.write(group.logs())
    group.stop_all()


# Fixtures that give a test the Django test database.
_DATABASE_FIXTURES = {
    "db",
    "transactional_db",
    "django_db_reset_sequences",
    "django_db_serialized_rollback",
    "live_server",
    "admin_user",
    "admin_client",
    "django_user_model",
}


def pytest_collection_modifyitems(config, items):
    """Mark the tests that touch the Django database ``uses_db``: ``make test`` runs those again
    on SQLite after the full suite on PostgreSQL (the rest does not depend on the database).

    Tests on real vLLM servers go last (stable order otherwise), so vLLM installs (fresh clone)
    and the servers boot while the rest of the suite runs; their time limit covers that wait."""
    for item in items:
        if item.get_closest_marker("django_db") or _DATABASE_FIXTURES & set(
            getattr(item, "fixturenames", ())
        ):
            item.add_marker(pytest.mark.uses_db)
    real = [item for item in items if _uses_real_vllm(item)]
    chosen = set(map(id, real))
    for item in items:
        group = "real-vllm" if id(item) in chosen else _shared_fixture_scope(item)  # one fleet
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    if real:
        for item in real:
            item.add_marker(pytest.mark.real_vllm)
            item.add_marker(pytest.mark.timeout(INSTALL_TIMEOUT_S + BOOT_TIMEOUT_S + 300))
        items[:] = [item for item in items if id(item) not in chosen] + real


def _shared_fixture_scope(item: pytest.Item) -> str | None:
    """The file of a test that takes a module-, class- or package-scoped fixture (a control plane
    and a browser, say): with ``--dist loadgroup`` (``make test``) such a file runs on one worker,
    which sets the fixture up once. Every other test is handed out one by one, in collection order,
    so pytest-django's order (plain database tests before transactional ones) holds per worker."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    for definitions in info.name2fixturedefs.values():
        if definitions and definitions[-1].scope in ("module", "class", "package"):
            return item.nodeid.split("::", 1)[0]
    return None


def _uses_real_vllm(item: pytest.Item) -> bool:
    """A test that takes ``real_vllm``, or a conformance test on its ``vllm`` side."""
    if "real_vllm" in getattr(item, "fixturenames", ()):
        return True
    callspec = getattr(item, "callspec", None)
    return callspec is not None and callspec.params.get("target") == "vllm"


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the real vLLM servers now, in the background, if any collected test uses them."""
    if session.config.option.collectonly:
        return
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # every worker collects every test: the one that runs them launches (the fixture)
    if any(_uses_real_vllm(item) for item in session.items):
        log_dir = ROOT / "var" / "test-logs"
        session.config.stash[_REAL_VLLM] = RealVLLMFleet.launch(log_dir)


def pytest_sessionfinish(session: pytest.Session) -> None:
    fleet = session.config.stash.get(_REAL_VLLM, None)
    if fleet is not None:
        fleet.stop()
        boots = ", ".join(
            f"{name} {server.ready_after_s:.0f} s"
            for name, server in fleet.servers.items()
            if server.ready_after_s is not None
        )
        if boots:
            sys.stderr.write(f"\nreal vLLM servers ready after: {boots}\n")


_REAL_VLLM = pytest.StashKey[RealVLLMFleet]()


@pytest.fixture(scope="session")
def real_vllm(request: pytest.FixtureRequest) -> RealVLLMFleet:
    """The session's real vLLM servers (tests/real_vllm.py), ready; FAILS loudly without vLLM."""
    fleet = request.config.stash.get(_REAL_VLLM, None)
    if fleet is None:  # e.g. selected with -k after collection: launch now
        fleet = RealVLLMFleet.launch(ROOT / "var" / "test-logs")
        request.config.stash[_REAL_VLLM] = fleet
    fleet.wait_ready()
    return fleet


@pytest.fixture(autouse=True)
def _close_connections_of_the_async_thread(request):
    """Close the database connection asgiref's sync thread opened for this test, if any.

    Async code (the dashboard socket's auth middleware) reaches the database on asgiref's single
    sync thread, whose connection outlives the test; on PostgreSQL it then kept the test database
    from being dropped at the end of the run ("being accessed by other users")."""
    yield
    if request.node.get_closest_marker("uses_db") is None:
        return
    from asgiref.sync import SyncToAsync
    from django.db import connections

    SyncToAsync.single_thread_executor.submit(connections.close_all).result(timeout=10)


@pytest.fixture(autouse=True)
def _fresh_request_path_backoff():
    """A test that made Redis fail must not leave the next one skipping Redis for seconds."""
    yield
    from django.conf import settings

    if settings.configured:
        from controlplane.connections import request_path_backoff

        request_path_backoff.cache_clear()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


_MIGRATED: dict[str, Path] = {}
_MIGRATED_LOCK = threading.RLock()


def migrated_sqlite(destination: Path, *, operator: tuple[str, str] | None = None) -> str:
    """Write a migrated SQLite database to ``destination``, as ``manage.py migrate`` (and, with
    ``operator`` = (username, password), ``createoperator``) would; return that operator's token.

    The migrations run once per pytest process into a template file and each caller gets a copy:
    every migrate (and createoperator, whose password hash is slow on purpose) was a Django process
    of its own, seconds of CPU each, for the same bytes. Tests of the migrations themselves
    (tests/controlplane/test_migrations.py) and of createoperator still run the real commands."""
    key = f"{operator[0]}:{operator[1]}" if operator else ""
    with _MIGRATED_LOCK:
        if key not in _MIGRATED:
            _MIGRATED[key] = _build_template(operator)
        template = _MIGRATED[key]
    shutil.copyfile(template, destination)
    return (template.parent / "token").read_text() if operator else ""


def _build_template(operator: tuple[str, str] | None) -> Path:
    directory = Path(tempfile.mkdtemp(prefix="gorgo-migrated-"))
    atexit.register(shutil.rmtree, directory, True)
    path = directory / "db.sqlite3"
    env = {**os.environ, "DATABASE_URL": f"sqlite:///{path}"}
    manage = [sys.executable, "manage.py"]
    if operator is None:
        run_checked([*manage, "migrate", "--no-input", "-v", "0"], cwd=ROOT, env=env)
    else:
        migrated_sqlite(path)
        username, password = operator
        token = run_checked(
            [*manage, "createoperator", "--username", username, "--password", password, "-v", "0"],
            cwd=ROOT,
            env=env,
        ).strip()
        (directory / "token").write_text(token)
    # The settings put SQLite in WAL mode: fold the log into the file so one file is the database.
    connection = sqlite3.connect(path)
    try:
        connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        connection.close()
    return path


E2E_OPERATOR = ("e2e", "e2e-operator-pw")  # the account ``control_plane`` makes: (username, password)


@dataclass(frozen=True)
class ControlPlane:
    """A control plane running as a real ASGI process on its own SQLite file database."""

    url: str
    token: str
    env: dict[str, str]

    def api(self) -> httpx.Client:
        return httpx.Client(
            base_url=f"{self.url}/api/v1", headers={"Authorization": f"Token {self.token}"}, timeout=10.0
        )

    def manage(self, *args: str) -> str:
        """Run a manage.py command against this control plane's database; return its stdout."""
        return run_checked([sys.executable, "manage.py", *args], cwd=ROOT, env={**os.environ, **self.env})


@pytest.fixture
def e2e_database_url(tmp_path: Path) -> Iterator[str]:
    """The database of a real control plane: a SQLite file, or, with ``GORGO_E2E_POSTGRES_URL``
    (a server URL, e.g. ``postgres://postgres@127.0.0.1:5432/postgres``), a PostgreSQL database of
    its own, named for this test and dropped afterwards (so concurrent runs never share one)."""
    server = os.environ.get("GORGO_E2E_POSTGRES_URL", "")
    if not server:
        yield f"sqlite:///{tmp_path / 'controlplane.sqlite3'}"
        return
    import psycopg

    name = f"gorgo_e2e_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield server.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with psycopg.connect(server, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def control_plane(
    processes: ProcessGroup, e2e_database_url: str, redis_url: str, redis_keys: RedisKeys
) -> ControlPlane:
    """Migrate a fresh database, create an operator, and serve the control plane with uvicorn.

    Every process the test starts through ``processes`` shares this Redis namespace.
    """
    env = {
        "DEBUG": "true",
        "DATABASE_URL": e2e_database_url,
        "REDIS_URL": redis_url,
        "GORGO_REDIS_PREFIX": redis_keys.prefix,
    }
    processes.env.update(env)
    port = free_port()
    plane = ControlPlane(url=f"http://127.0.0.1:{port}", token="", env=env)
    operator = E2E_OPERATOR
    if e2e_database_url.startswith("sqlite:///"):
        token = migrated_sqlite(Path(e2e_database_url.removeprefix("sqlite:///")), operator=operator)
    else:
        plane.manage("migrate", "--no-input", "-v", "0")
        token = plane.manage(
            "createoperator", "--username", operator[0], "--password", operator[1], "-v", "0"
        ).strip()
    processes.start(
        "web",
        [
            sys.executable,
            "-m",
            "uvicorn",
            "controlplane.asgi:application",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        ready_url=f"{plane.url}/admin/login/",
    )
    return ControlPlane(url=plane.url, token=token, env=env)
