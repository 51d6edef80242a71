"""Schemathesis against a live control plane: every check, zero failures.

The control plane runs as a real process on a seeded demo database, as `make run` serves it
(DEBUG off); schemathesis reads ``/api/schema/`` and sends generated requests (valid and invalid)
to every operation. Its auth checks send bad tokens on purpose: the sign-in throttle is raised for
this process so they do not turn every later request into a 429. Bounded: a fixed seed, ``MAX_EXAMPLES`` cases per operation and phase, one worker.
Configuration and the one reasoned adjustment: tests/api/schemathesis.toml.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ControlPlane, ProcessGroup, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

MAX_EXAMPLES = 5
CONFIG = Path(__file__).with_name("schemathesis.toml")


def test_the_api_passes_every_schemathesis_check(
    control_plane: ControlPlane, processes: ProcessGroup, tmp_path: Path
) -> None:
    control_plane.manage("seed_demo")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    processes.start(
        "web-fuzzed",
        [
            sys.executable,
            "-m",
            "uvicorn",
            "controlplane.asgi:application",
            "--port",
            str(port),
            "--no-access-log",
        ],
        env={"DEBUG": "false", "GORGO_AUTH_FAILURES": "1000000", "LOG_LEVEL": "ERROR"},
        ready_url=f"{url}/login/",
    )
    command = [
        str(Path(sys.executable).with_name("schemathesis")),
        "--config-file",
        str(CONFIG),
        "run",
        f"{url}/api/schema/",
        "--header",
        f"Authorization: Token {control_plane.token}",
        "--checks",
        "all",
        "--phases",
        "examples,coverage,fuzzing",
        "--max-examples",
        str(MAX_EXAMPLES),
        "--seed",
        "1",
        "--workers",
        "1",
        "--request-timeout",
        "10",
        "--generation-database",
        "none",
        "--no-color",
    ]
    started = time.monotonic()
    run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=200)
    elapsed_s = time.monotonic() - started
    output = run.stdout + run.stderr
    generated = re.search(r"(\d+) generated", output)
    sys.stdout.write(f"schemathesis: {generated.group(0) if generated else '?'} in {elapsed_s:.0f} s\n")
    assert run.returncode == 0, output[-20000:]
