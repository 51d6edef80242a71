"""Fixtures every part of the suite shares: Redis, free ports, and real processes on loopback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis

from routing.contract import RedisKeys

ROOT = Path(__file__).resolve().parent.parent
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
        deadline = time.monotonic() + timeout_s
        while ready_url or ready_text:
            if not process.alive():
                raise RuntimeError(f"{name} exited with {popen.returncode}:\n{process.log()[-4000:]}")
            if ready_text and ready_text in process.log():
                break
            if ready_url:
                try:
                    if httpx.get(ready_url, timeout=1.0).is_success:
                        break
                except httpx.HTTPError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not ready after {timeout_s}s:\n{process.log()[-4000:]}")
            time.sleep(0.1)
        return process

    def stop(self, name: str, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
        process = self.processes.pop(name)
        if process.alive():
            os.killpg(process.popen.pid, sig)
            try:
                process.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(process.popen.pid, signal.SIGKILL)
                process.popen.wait(5)

    def stop_all(self) -> None:
        for name in list(self.processes):
            self.stop(name)

    def logs(self) -> str:
        return "\n".join(f"----- {p.name} -----\n{p.log()[-3000:]}" for p in self.processes.values())


@pytest.fixture
def processes(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[ProcessGroup]:
    """Real processes for this test, stopped afterwards; their logs are printed if the test failed."""
    group = ProcessGroup(directory=tmp_path)
    yield group
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        sys.stderr.write(group.logs())
    group.stop_all()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


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
        result = subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=ROOT,
            env={**os.environ, **self.env},
            capture_output=True,
            text=True,
            timeout=120,
        )
        if result.returncode != 0:
            raise RuntimeError(f"manage.py {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
        return result.stdout


@pytest.fixture
def control_plane(
    processes: ProcessGroup, tmp_path: Path, redis_url: str, redis_keys: RedisKeys
) -> ControlPlane:
    """Migrate a fresh database, create an operator, and serve the control plane with uvicorn.

    Every process the test starts through ``processes`` shares this Redis namespace.
    """
    env = {
        "DEBUG": "true",
        "DATABASE_URL": f"sqlite:///{tmp_path / 'controlplane.sqlite3'}",
        "REDIS_URL": redis_url,
        "GORGO_REDIS_PREFIX": redis_keys.prefix,
    }
    processes.env.update(env)
    port = free_port()
    plane = ControlPlane(url=f"http://127.0.0.1:{port}", token="", env=env)
    plane.manage("migrate", "--no-input", "-v", "0")
    token = plane.manage(
        "createoperator", "--username", "e2e", "--password", "e2e-operator-pw", "-v", "0"
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
