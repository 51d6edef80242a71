"""Real vLLM servers (vLLM's CPU build, the tiny random-weight Llama) for the tests.

Started ONCE per pytest session and early: ``pytest_collection_finish`` (tests/conftest.py) calls
``RealVLLMFleet.launch`` when any collected test asks for the ``real_vllm`` fixture, so the servers
boot (about a minute each, cold) while the rest of the suite runs; the tests that need them are
moved to the end of the run, and the fixture only waits for readiness. Stopped by process group
(their pids) when the session ends.

Two servers, the two KV-event endpoint shapes vLLM knows (``vllm/distributed/kv_events.py``:
an endpoint with ``*``, ``::``, ``ipc://`` or ``inproc://`` is bound, any other is connected to):

- ``bind``: ``--kv-events-config`` endpoint ``tcp://*:P`` (vLLM binds; subscribers connect to
  ``tcp://127.0.0.1:P``), replay ``tcp://*:R``, ``--enable-prompt-tokens-details``.
- ``connect``: endpoint ``tcp://127.0.0.1:P`` (vLLM connects out; a subscriber must BIND there),
  replay ``tcp://*:R``, WITHOUT ``--enable-prompt-tokens-details`` (usage has no
  ``prompt_tokens_details``).

Both: ``--enable-prefix-caching``, ``--block-size 32`` (CPU attention needs a multiple of 32), ``VLLM_CPU_KVCACHE_SPACE=1`` (1 GiB of KV
cache; ~3.5 GB of memory per server). A gateway e2e test takes ``real_vllm`` and reads
``real_vllm.servers["bind"].url`` / ``.kv_events_connect`` / ``.replay_connect``.

Where vLLM cannot be installed (scripts/ensure_vllm.py failed) the fixture FAILS with the reason:
never a silent skip.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from simulator.harness import stop_process_group

ROOT = Path(__file__).resolve().parent.parent
VLLM_VENV = Path(os.environ.get("GORGO_VLLM_VENV", ROOT / "var" / "vllm-venv"))
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
MODEL_FOLDER = ROOT / "var" / "tiny-llama"
MODEL_NAME = "tiny-llama"
BLOCK_SIZE_TOKENS = 32  # vLLM CPU attention: "No common block size for 16 (CPU_ATTN: [MultipleOf(32)])"
INSTALL_TIMEOUT_S = 1200.0  # a cold install is ~4 min; a slow mirror may take longer
BOOT_TIMEOUT_S = 900.0  # cold boot is ~70 s alone; two at once on 2 busy cores take longer


@dataclass(frozen=True, slots=True)
class RealVLLMSpec:
    """How one real vLLM server is started: its ports and the flags that differ between servers."""

    name: str
    port: int
    kv_events_port: int
    replay_port: int
    bind_events: bool  # True: endpoint tcp://*:P (vLLM binds); False: tcp://127.0.0.1:P (connects)
    prompt_tokens_details: bool

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_events_endpoint(self) -> str:
        """The endpoint as written in --kv-events-config."""
        host = "*" if self.bind_events else "127.0.0.1"
        return f"tcp://{host}:{self.kv_events_port}"

    @property
    def kv_events_connect(self) -> str:
        """Where a subscriber connects (bind shape) or binds (connect shape)."""
        return f"tcp://127.0.0.1:{self.kv_events_port}"

    @property
    def replay_connect(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def kv_events_config(self) -> dict[str, object]:
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.kv_events_endpoint,
            "replay_endpoint": f"tcp://*:{self.replay_port}",
            "topic": "kv",
        }

    def argv(self, python: Path = VLLM_PYTHON, model: Path = MODEL_FOLDER) -> list[str]:
        # `vllm serve` works because scripts/ensure_vllm.py gives the vllm-cpu distribution a
        # `vllm` metadata alias (version 0.32.0+cpu, as vLLM's own fallback computes it).
        argv = [
            str(python.parent / "vllm"),
            "serve",
            str(model),
            "--served-model-name",
            MODEL_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--block-size",
            str(BLOCK_SIZE_TOKENS),
            "--max-model-len",
            "2048",
            "--max-num-seqs",
            "8",
            "--enable-prefix-caching",
            "--kv-events-config",
            json.dumps(self.kv_events_config()),
            "--disable-uvicorn-access-log",
            # No torch.compile: it costs ~25 s of CPU per boot (its cache does not load back on
            # 0.32's CPU build: "'function' object has no attribute 'finalize_loading'") and
            # changes nothing gorgo observes. The served API, cache and events are the same.
            "--enforce-eager",
        ]
        if self.prompt_tokens_details:
            argv.append("--enable-prompt-tokens-details")
        return argv


def server_env() -> dict[str, str]:
    return {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        # The emulator's ensure_redis etc. do not concern vLLM; keep gorgo's venv off its path.
        "VIRTUAL_ENV": str(VLLM_VENV),
        "PATH": f"{VLLM_VENV / 'bin'}:{os.environ.get('PATH', '')}",
    }


@dataclass
class RealVLLMServer:
    """One running (or booting) real vLLM process."""

    spec: RealVLLMSpec
    popen: subprocess.Popen
    log_path: Path
    started_monotonic_s: float
    ready_after_s: float | None = None

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def kv_events_connect(self) -> str:
        return self.spec.kv_events_connect

    @property
    def replay_connect(self) -> str:
        return self.spec.replay_connect

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout_s: float = BOOT_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if self.popen.poll() is not None:
                raise RuntimeError(
                    f"real vLLM {self.spec.name!r} exited ({self.popen.returncode}) while booting:\n"
                    + self.log()[-6000:]
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"real vLLM {self.spec.name!r} not ready within {timeout_s:g}s:\n" + self.log()[-6000:]
                )
            time.sleep(0.5)
        if self.ready_after_s is None:
            self.ready_after_s = time.monotonic() - self.started_monotonic_s

    def stop(self) -> None:
        stop_process_group(self.popen, signal.SIGTERM, timeout_s=20.0)


def start_server(spec: RealVLLMSpec, log_dir: Path) -> RealVLLMServer:
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"vllm-{spec.name}.log"
    with log_path.open("ab") as log_file:
        popen = subprocess.Popen(
            spec.argv(),
            cwd=ROOT,
            env=server_env(),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return RealVLLMServer(spec=spec, popen=popen, log_path=log_path, started_monotonic_s=time.monotonic())


# The servers' ports are chosen at the session's start but bound only when vLLM is up, minutes later
# on a busy machine; a port from the kernel's ephemeral range (what ``free_port`` hands out) may be
# taken by then by any other test's client or server. Ports below that range are never handed out
# implicitly, so one that is free now stays free (a CI run saw "Address already in use" otherwise).
QUIET_PORTS = range(20_000, 32_000)
_chosen: set[int] = set()


def quiet_port() -> int:
    """A free TCP port on 127.0.0.1 below the ephemeral range, not chosen before in this process."""
    for _ in range(200):
        port = random.choice(QUIET_PORTS)
        if port in _chosen:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _chosen.add(port)
        return port
    raise RuntimeError(
        f"no free port in {QUIET_PORTS.start}-{QUIET_PORTS.stop - 1} for the real vLLM servers"
    )


def default_specs() -> tuple[RealVLLMSpec, ...]:
    return (
        RealVLLMSpec(
            name="bind",
            port=quiet_port(),
            kv_events_port=quiet_port(),
            replay_port=quiet_port(),
            bind_events=True,
            prompt_tokens_details=True,
        ),
        RealVLLMSpec(
            name="connect",
            port=quiet_port(),
            kv_events_port=quiet_port(),
            replay_port=quiet_port(),
            bind_events=False,
            prompt_tokens_details=False,
        ),
    )


@dataclass
class RealVLLMFleet:
    """The session's real vLLM servers, or why there are none (``error``)."""

    log_dir: Path
    servers: dict[str, RealVLLMServer] = field(default_factory=dict)
    error: str | None = None
    launched_monotonic_s: float = 0.0
    _thread: threading.Thread | None = None

    @classmethod
    def launch(cls, log_dir: Path) -> RealVLLMFleet:
        """Install vLLM if needed, build the model and start every server, in a background
        thread (returns at once): on a fresh clone the ~3-minute install overlaps the suite too."""
        fleet = cls(log_dir=log_dir, launched_monotonic_s=time.monotonic())
        fleet._thread = threading.Thread(
            target=fleet._prepare_and_start, name="real-vllm-launch", daemon=True
        )
        fleet._thread.start()
        return fleet

    def _prepare_and_start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            with (self.log_dir / "ensure-vllm.log").open("ab") as log:
                installed = subprocess.run(
                    [sys.executable, str(ROOT / "scripts" / "ensure_vllm.py")],
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                    timeout=INSTALL_TIMEOUT_S,
                )
            if installed.returncode != 0 or not VLLM_PYTHON.exists():
                tail = (self.log_dir / "ensure-vllm.log").read_text(errors="replace")[-3000:]
                self.error = (
                    f"vLLM's CPU build could not be installed in {VLLM_VENV} "
                    f"(scripts/ensure_vllm.py exited {installed.returncode}):\n{tail}"
                )
                return
            built = subprocess.run(
                [str(VLLM_PYTHON), str(ROOT / "scripts" / "ensure_tiny_model.py"), str(MODEL_FOLDER)],
                capture_output=True,
                text=True,
                env=server_env(),
                timeout=300,
            )
            if built.returncode != 0:
                self.error = "building the tiny model failed:\n" + built.stderr[-4000:]
                return
            for spec in default_specs():
                self.servers[spec.name] = start_server(spec, self.log_dir)
        except (OSError, subprocess.SubprocessError) as exc:
            self.error = f"starting real vLLM failed: {exc!r}"

    def wait_ready(self) -> None:
        if self._thread is not None:
            self._thread.join(INSTALL_TIMEOUT_S + 300)
            if self._thread.is_alive():
                self.error = self.error or "installing vLLM / building the model did not finish in time"
        if self.error is not None:
            raise RuntimeError(f"REAL vLLM UNAVAILABLE: {self.error}")
        for server in self.servers.values():
            server.wait_ready()

    def restart(self, name: str) -> RealVLLMServer:
        """Stop one server and start a new process with the same spec (ports); waits until ready."""
        old = self.servers[name]
        old.stop()
        new = start_server(old.spec, self.log_dir)
        self.servers[name] = new
        new.wait_ready()
        return new

    def stop(self) -> None:
        if self._thread is not None:
            self._thread.join(INSTALL_TIMEOUT_S + 300)  # never leave a server starting behind us
        for server in self.servers.values():
            server.stop()
