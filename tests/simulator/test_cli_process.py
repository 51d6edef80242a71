"""``python -m simulator`` starts, prints its node table, serves, and stops cleanly on SIGTERM."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx

from simulator.__main__ import READY_LINE
from tests.conftest import ROOT, ProcessGroup
from tests.simulator.conftest import MODEL

URL_RE = re.compile(r"^(\S+)\s+(\S+)\s+(http://127\.0\.0\.1:\d+)$", re.MULTILINE)


def test_it_serves_the_chosen_nodes_on_auto_ports_and_stops_on_sigterm(processes: ProcessGroup) -> None:
    process = processes.start(
        "simulator",
        [sys.executable, "-m", "simulator", "--auto-ports", "--only", "us-east-1,ap-south-2"],
        ready_text=READY_LINE,
    )
    rows = {name: (region, url) for name, region, url in URL_RE.findall(process.log())}
    assert set(rows) == {"us-east-1", "ap-south-2"}
    assert rows["us-east-1"][0] == "us-east"
    assert rows["ap-south-2"][0] == "ap-south"

    url = rows["us-east-1"][1]
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    answer = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
        timeout=10,
    )
    assert answer.json()["usage"]["completion_tokens"] == 3
    assert "vllm:num_requests_running" in httpx.get(f"{url}/metrics", timeout=5).text

    processes.stop("simulator")
    assert process.popen.returncode == 0
    assert "simulator stopping" in process.log()


def test_it_rejects_an_unknown_node_name() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "simulator", "--auto-ports", "--only", "mars-1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert completed.returncode == 2
    assert "mars-1" in completed.stderr


def test_skip_region_leaves_that_regions_nodes_to_real_vllm(processes: ProcessGroup) -> None:
    """``GORGO_FLEET=vllm make run`` serves ap-south with real vLLM and the rest emulated."""
    process = processes.start(
        "simulator",
        [sys.executable, "-m", "simulator", "--auto-ports", "--skip-region", "ap-south"],
        ready_text=READY_LINE,
    )
    rows = {name: region for name, region, _ in URL_RE.findall(process.log())}
    assert set(rows) == {"us-east-1", "us-east-2", "eu-central-1", "eu-central-2"}


def test_a_bad_engine_default_is_refused_naming_it() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "simulator", "--auto-ports", "--engine-default", "prefill_tokens_per_s=fast"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert completed.returncode == 2
    assert "prefill_tokens_per_s" in completed.stderr and "'fast'" in completed.stderr
