"""`make run` defaults are safe: no DEBUG, a generated SECRET_KEY, offline API docs, masked logs.

The control plane runs as a real process without DEBUG (what `make run` starts): pages, the admin
and their static files must still work, and nothing technical may leak.
"""

from __future__ import annotations

import re
import stat
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from controlplane.settings import generated_secret_key
from routing.contract import RedisKeys
from tests.conftest import (
    E2E_OPERATOR,
    ROOT,
    ControlPlane,
    ProcessGroup,
    delete_namespace,
    free_port,
    migrated_sqlite,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def production_web(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[str]:
    """A migrated control-plane database (with ``control_plane``'s operator) served with DEBUG off,
    as `make run` does. One per module: its tests only read (and sign in), and each web process
    was seconds of startup."""
    directory = tmp_path_factory.mktemp("production-web")
    keys = RedisKeys(prefix=f"gorgotest-{uuid.uuid4().hex}")
    database = directory / "db.sqlite3"
    migrated_sqlite(database, operator=E2E_OPERATOR)
    env = {
        "DEBUG": "false",
        "DATABASE_URL": f"sqlite:///{database}",
        "REDIS_URL": redis_url,
        "GORGO_REDIS_PREFIX": keys.prefix,
    }
    group = ProcessGroup(directory=directory, env=env)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    try:
        group.start(
            "web-production",
            [sys.executable, "-m", "uvicorn", "controlplane.asgi:application", "--port", str(port)],
            ready_url=f"{url}/login/",
        )
        yield url
    finally:
        group.stop_all()
        delete_namespace(redis.Redis.from_url(redis_url), keys.prefix)


def test_make_run_does_not_turn_debug_on() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert not re.search(r"^\s*(export\s+)?DEBUG\s*[?:]?=", makefile, re.MULTILINE)


def test_it_keeps_a_generated_secret_key_private_and_stable(tmp_path: Path) -> None:
    path = tmp_path / "var" / "secret-key"
    key = generated_secret_key(path)
    assert len(key) >= 40
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert generated_secret_key(path) == key


def test_pages_admin_and_static_files_work_without_debug(production_web: str) -> None:
    with httpx.Client(base_url=production_web, timeout=10.0) as web:
        login = web.get("/login/")
        assert login.status_code == 200
        for asset in set(re.findall(r'(?:href|src)="(/static/[^"]+)"', login.text)):
            assert web.get(asset).status_code == 200, asset
        token = web.cookies["csrftoken"]
        signed_in = web.post(
            "/login/",
            data={"username": E2E_OPERATOR[0], "password": E2E_OPERATOR[1], "csrfmiddlewaretoken": token},
            headers={"Referer": f"{production_web}/login/"},
        )
        assert signed_in.status_code == 302, signed_in.text[:500]
        overview = web.get("/")
        assert overview.status_code == 200
        assets = set(re.findall(r'(?:href|src)="(/(?:static|vendor)/[^"]+)"', overview.text))
        assert assets
        for asset in assets:
            assert web.get(asset).status_code == 200, asset
        admin = web.get("/admin/")
        assert admin.status_code == 200
        assert web.get("/static/admin/css/base.css").status_code == 200


def test_api_docs_work_offline(production_web: str) -> None:
    docs = httpx.get(f"{production_web}/api/docs/", timeout=10.0)
    assert docs.status_code == 200
    assert "cdn.jsdelivr" not in docs.text and "unpkg" not in docs.text
    assets = re.findall(r'(?:href|src)="([^"]+\.(?:js|css|png))"', docs.text)
    assert any("swagger-ui-bundle" in asset for asset in assets)
    for asset in assets:
        assert asset.startswith("/static/"), asset
        assert httpx.get(f"{production_web}{asset}", timeout=10.0).status_code == 200, asset


def test_a_404_lists_no_urls(production_web: str) -> None:
    response = httpx.get(f"{production_web}/no-such-page/", timeout=10.0)
    assert response.status_code == 404
    assert "URLconf" not in response.text and "api/v1" not in response.text


def test_the_gateway_masks_redis_credentials_in_its_log(processes: ProcessGroup, redis_keys) -> None:
    port = free_port()
    process = processes.start(
        "gateway",
        [sys.executable, "-m", "routing", "--region", "us-east", "--port", str(port)],
        env={
            "REDIS_URL": "redis://gorgo:hunter2-userinfo@127.0.0.1:6379/0?password=hunter2-query",
            "GORGO_REDIS_PREFIX": redis_keys.prefix,
        },
        ready_text="starting",
    )
    log = process.log()
    assert "hunter2" not in log
    assert "redis://gorgo:***@127.0.0.1:6379/0?password=***" in log


def test_the_web_command_never_believes_x_forwarded_for_from_loopback(
    control_plane: ControlPlane, processes: ProcessGroup
) -> None:
    """The Procfile's web command (what `make run` starts): uvicorn by default takes the client
    address from X-Forwarded-For when the peer is 127.0.0.1, so a guesser on the machine (or behind
    a local proxy that passes the header on) named a new address per request and was never
    throttled. The control plane decides whom to believe (GORGO_TRUSTED_PROXIES, default none)."""
    web = next(line for line in (ROOT / "Procfile").read_text().splitlines() if line.startswith("web:"))
    argv = web.removeprefix("web:").split()
    assert argv[0].endswith("uvicorn")
    port = free_port()
    argv = [sys.executable, "-m", "uvicorn", *argv[1:]]
    argv[argv.index("--port") + 1] = str(port)
    url = f"http://127.0.0.1:{port}"
    processes.start("web-procfile", argv, env={"GORGO_AUTH_FAILURES": "3"}, ready_url=f"{url}/login/")
    statuses = []
    with httpx.Client(base_url=url, headers={"Authorization": "Token " + "0" * 40}, timeout=10) as guesser:
        for index in range(5):
            answer = guesser.get("/api/v1/regions/", headers={"X-Forwarded-For": f"203.0.113.{index}"})
            statuses.append(answer.status_code)
    assert statuses == [401, 401, 401, 429, 429], statuses
