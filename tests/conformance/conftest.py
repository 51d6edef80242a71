"""Two targets for one suite: an emulated node pair (``python -m simulator``) and a real vLLM pair.

Each target is a ``Pair`` of two servers configured alike on both sides (tests/real_vllm.py):
``bind`` (KV events on ``tcp://*:P``, replay, ``--enable-prompt-tokens-details``) and ``connect``
(KV events connecting out to ``tcp://127.0.0.1:P``, replay, no prompt-tokens details). A test
takes ``target`` and runs once per side; where the emulator and vLLM disagree, vLLM is right.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from simulator.harness import stop_process_group, wait_until
from tests.real_vllm import BLOCK_SIZE_TOKENS, MODEL_NAME, RealVLLMFleet, RealVLLMSpec, default_specs

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Pair:
    """What a conformance test needs of one side: its two servers and how to restart one."""

    kind: str  # "emulated" or "vllm"
    specs: dict[str, RealVLLMSpec]
    model: str
    block_size: int
    _restart: object

    def url(self, name: str) -> str:
        return self.specs[name].url

    def restart(self, name: str) -> None:
        self._restart(name)  # type: ignore[operator]


_TOPOLOGY = """
[fleet]
name = "conformance"
model = "{model}"
host = "127.0.0.1"

[network]
intra_region_rtt_ms = 0.0
intra_region_jitter_ms = 0.0
jitter_ms = 0.0

[engine]
max_model_len = 2048
block_size = {block_size}
kv_capacity_blocks = 4096

[[regions]]
slug = "local"
name = "Local"
latitude = 0.0
longitude = 0.0
{nodes}
"""

_NODE = """
[[nodes]]
name = "{name}"
region = "local"
port = {port}
enable_prompt_tokens_details = {details}
kv_events_config = '{events}'
"""


class EmulatedPair:
    """``python -m simulator`` serving the two nodes, one process per node (so one can restart)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.specs = {spec.name: spec for spec in default_specs()}
        nodes = "".join(
            _NODE.format(
                name=spec.name,
                port=spec.port,
                details="true" if spec.prompt_tokens_details else "false",
                events=json.dumps(spec.kv_events_config()),
            )
            for spec in self.specs.values()
        )
        self.topology = directory / "conformance.toml"
        self.topology.write_text(
            _TOPOLOGY.format(model=MODEL_NAME, block_size=BLOCK_SIZE_TOKENS, nodes=nodes)
        )
        self.processes: dict[str, subprocess.Popen] = {}
        for name in self.specs:
            self.start(name)

    def start(self, name: str) -> None:
        log = (self.directory / f"emulated-{name}.log").open("ab")
        popen = subprocess.Popen(
            [sys.executable, "-m", "simulator", "--topology", str(self.topology), "--only", name],
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        self.processes[name] = popen
        url = self.specs[name].url
        wait_until(lambda: _healthy(url), 30, what=f"emulated {name} ready", process=popen)

    def restart(self, name: str) -> None:
        stop_process_group(self.processes.pop(name), signal.SIGTERM)
        self.start(name)

    def stop(self) -> None:
        for popen in self.processes.values():
            stop_process_group(popen)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="session")
def emulated_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmulatedPair]:
    pair = EmulatedPair(tmp_path_factory.mktemp("emulated"))
    yield pair
    pair.stop()


def _vllm_side(fleet: RealVLLMFleet) -> Pair:
    return Pair(
        kind="vllm",
        specs={name: server.spec for name, server in fleet.servers.items()},
        model=MODEL_NAME,
        block_size=BLOCK_SIZE_TOKENS,
        _restart=fleet.restart,
    )


@pytest.fixture
def emulated(emulated_pair: EmulatedPair) -> Pair:
    return Pair(
        kind="emulated",
        specs=emulated_pair.specs,
        model=MODEL_NAME,
        block_size=BLOCK_SIZE_TOKENS,
        _restart=emulated_pair.restart,
    )


@pytest.fixture
def vllm(real_vllm: RealVLLMFleet) -> Pair:
    return _vllm_side(real_vllm)


@pytest.fixture(params=["emulated", "vllm"])
def target(request: pytest.FixtureRequest) -> Pair:
    """Each conformance test runs against the emulator and against real vLLM."""
    return request.getfixturevalue(request.param)
