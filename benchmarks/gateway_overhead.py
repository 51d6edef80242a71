"""Gateway overhead as users see it: three mock OpenAI upstreams, wrk, CPU per request, one run.

    python benchmarks/gateway_overhead.py            # from the repo root; ~2 minutes, bounded

Targets (each a real process on 127.0.0.1; the proxies spread requests over three no-delay mock
OpenAI backends, each its own process):
- ``direct``: one mock itself (the baseline every "added" figure is relative to);
- ``gorgo+frontdoor`` (the headline): ``python -m routing`` with a real policy snapshot in Redis
  (3 nodes, the ``gorgo`` algorithm unless ``--algorithm``), the request log on, and its front
  door on (``GORGO_AUTH=on``, one client key with request and token limits: every request is
  authenticated and rate-limited);
- ``gorgo``: the same gateway with the front door off (OpenTelemetry tracing is off in every
  target but one: no ``OTEL_EXPORTER_OTLP_ENDPOINT``);
- ``gorgo+frontdoor x2``: the headline gateway with ``--workers 2`` (1 -> 2 worker scaling);
- ``gorgo+tracing``: ``gorgo`` with tracing on, every request sampled, spans exported over
  OTLP/HTTP to another mock process standing in for the collector (it answers 200 to every POST);
- ``vllm-router``: the Rust vLLM router (``pip install -e '.[peers]'``; ``make bench`` does), round robin;
- ``asgi+aiohttp``: the smallest raw-ASGI proxy on uvicorn (uvloop, httptools) with aiohttp,
  round robin (``--with-httpx`` adds the same with httpx).
LiteLLM is not measured: it is not in the ``peers`` extra (issue 15 measured +19 ms p50 and
55-66 req/s for it on this machine).

Per target: ``p50_ms_c1``/``p99_ms_c1`` (non-streaming chat completions, one client,
keep-alive), ``rps_c32`` (wrk, 32 connections, one thread; a Python client when wrk is missing,
see scripts/ensure_wrk.sh), ``cpu_us_per_request`` (user + system CPU of the target's whole
process group, from /proc, during the wrk run, divided by the requests wrk completed) and
``rps_per_core`` (its inverse: requests per CPU-second), ``stream_ttfb_p50_ms_c1``/``_c8``
(streaming clients: request sent -> first SSE ``data:``). Writes
benchmarks/results/gateway_overhead.{json,md}; the issue 15 targets compare ``gorgo+frontdoor``
with ``vllm-router`` from the same run.

Issue 12's budget for the front door (+0.05 ms p50, 10 % throughput) is judged apart, after the
table: ``gorgo``, an identical twin and ``gorgo+frontdoor`` take turns for ``--pair-rounds``
rounds (see ``pairs_in_turns``); medians and IQRs over the rounds, the twin as the noise floor.

The mock backend and the minimal proxies live in benchmarks/overhead_servers.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from overhead_servers import MODEL  # this directory is on sys.path when run as a script

from simulator.harness import exit_on_sigterm, free_port, group_processes, stop_process_group, wait_until

ROOT = Path(__file__).resolve().parent.parent
SHADOW_BUDGET_US = 10.0  # issue 23: a shadow adds at most this much gateway CPU per request
RESULTS = ROOT / "benchmarks" / "results"
SERVERS = str(ROOT / "benchmarks" / "overhead_servers.py")
CHAT_BODY = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "Say hello in one word."}], "max_tokens": 8}
).encode()
STREAM_BODY = json.dumps(
    {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello in one word."}],
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
).encode()
# The bench key: limits high enough never to refuse, so every request runs the limiter.
BENCH_SECRET = "gorgo-sk-bench-0123456789abcdefghijklmnopqrstuvwxyz"
UPSTREAMS = 3  # mock backends behind every proxy

# ---- load generation -------------------------------------------------------------------------


def _request_bytes(port: int, body: bytes, auth: str = "") -> bytes:
    extra = b"authorization: Bearer %s\r\n" % auth.encode() if auth else b""
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\ncontent-type: application/json\r\n"
        b"%scontent-length: %d\r\n\r\n%s" % (port, extra, len(body), body)
    )


def _read_response(sock: socket.socket, buffer: bytearray) -> tuple[int, bytearray]:
    """Read one HTTP/1.1 response (content-length or chunked) from a blocking socket."""
    while b"\r\n\r\n" not in buffer:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("server closed the connection")
        buffer += data
    head_end = buffer.index(b"\r\n\r\n") + 4
    head = bytes(buffer[:head_end]).lower()
    status = int(head[9:12])
    match = re.search(rb"content-length: *(\d+)", head)
    if match:
        end = head_end + int(match.group(1))
        while len(buffer) < end:
            buffer += sock.recv(65536)
    else:
        while not buffer.endswith(b"0\r\n\r\n"):
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("server closed the connection")
            buffer += data
        end = len(buffer)
    return status, buffer[end:]


def latency_c1(port: int, requests: int, warmup: int, auth: str = "") -> list[float]:
    """Sequential non-streaming requests on one keep-alive connection; milliseconds each."""
    return latency_c1_interleaved([(port, auth)], requests, warmup)[0]


def latency_c1_interleaved(targets: list[tuple[int, str]], requests: int, warmup: int) -> list[list[float]]:
    """Sequential requests taking turns between ``targets`` ((port, client key) pairs; one
    keep-alive connection each, in a new random order every turn); milliseconds, one list per
    target (with one target: plain sequential requests). Consecutive requests see the
    same machine, so a small difference survives a noisy host (run apart, two identical gateways'
    p50s differ by more than 0.05 ms here; taking turns, by a few µs). The order is shuffled
    because a gateway asked twice in a row answers the second time from warm CPU caches: a fixed
    or mirrored order favours whoever sits at its ends."""
    shuffle = random.Random(12).shuffle
    sockets = [socket.create_connection(("127.0.0.1", port)) for port, _ in targets]
    payloads = [_request_bytes(port, CHAT_BODY, auth) for port, auth in targets]
    buffers = [bytearray() for _ in targets]
    samples: list[list[float]] = [[] for _ in targets]
    order = list(range(len(targets)))
    try:
        for sock in sockets:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for index in range(warmup + requests):
            shuffle(order)
            for which in order:
                start = time.perf_counter()
                sockets[which].sendall(payloads[which])
                status, buffers[which] = _read_response(sockets[which], buffers[which])
                elapsed_ms = (time.perf_counter() - start) * 1000
                if status != 200:
                    raise RuntimeError(f"status {status} from port {targets[which][0]}")
                if index >= warmup:
                    samples[which].append(elapsed_ms)
    finally:
        for sock in sockets:
            sock.close()
    return samples


async def _stream_worker(port: int, count: int, samples: list[float], auth: str = "") -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = _request_bytes(port, STREAM_BODY, auth)
    try:
        for _ in range(count):
            start = time.perf_counter()
            writer.write(payload)
            data = b""
            while b"data:" not in data:
                chunk = await reader.read(65536)
                if not chunk:
                    raise ConnectionError("closed")
                data += chunk
            samples.append((time.perf_counter() - start) * 1000)
            if not data.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"stream status {data[:20]!r}")
            while not data.endswith(b"0\r\n\r\n"):
                chunk = await reader.read(65536)
                if not chunk:
                    raise ConnectionError("closed")
                data += chunk
    finally:
        writer.close()


async def stream_ttfb(
    port: int, concurrency: int, per_client: int, warmup: int, auth: str = ""
) -> list[float]:
    """``concurrency`` clients each streaming ``per_client`` chat completions; TTFB (ms) of each."""
    await asyncio.gather(*(_stream_worker(port, warmup, [], auth) for _ in range(concurrency)))
    samples: list[float] = []
    await asyncio.gather(*(_stream_worker(port, per_client, samples, auth) for _ in range(concurrency)))
    return samples


def wrk_script(path: Path, auth: str = "", delay_ms: float = 0.0) -> Path:
    """A wrk script at ``path`` that POSTs the benchmark's chat completion (with ``auth`` as its key);
    ``delay_ms``: each connection waits that long after an answer before its next request (a paced
    load below saturation)."""
    path.write_text(
        'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
        + (f'wrk.headers["Authorization"] = "Bearer {auth}"\n' if auth else "")
        + f"wrk.body = {json.dumps(CHAT_BODY.decode())}\n"
        + (f"function delay() return {delay_ms:g} end\n" if delay_ms > 0 else "")
    )
    return path


def run_wrk(port: int, duration_s: float, script: Path, wrk: str = "wrk") -> tuple[str, int]:
    """wrk -t1 -c32 for ``duration_s`` against the chat endpoint on ``port``: (its output, requests
    done). Raises if wrk saw a non-2xx answer or a socket error."""
    result = subprocess.run(
        [
            wrk,
            *("-t1", "-c32", f"-d{duration_s:g}s", "--timeout", "30s", "-s", str(script)),
            f"http://127.0.0.1:{port}/v1/chat/completions",
        ],
        capture_output=True,
        text=True,
        timeout=duration_s + 60,
        check=True,
    )
    if "Non-2xx" in result.stdout or "Socket errors" in result.stdout:
        raise RuntimeError(f"wrk saw errors on port {port}:\n{result.stdout}")
    done = re.search(r"(\d+) requests in", result.stdout)
    if not done:
        raise RuntimeError(f"cannot read wrk output:\n{result.stdout}")
    return result.stdout, int(done.group(1))


def throughput_c32(port: int, duration_s: float, auth: str = "") -> tuple[float, int, str]:
    """(requests/s, requests done) at 32 connections: wrk if installed, else a Python client."""
    wrk = shutil.which("wrk")
    if wrk is None:
        rps = _python_throughput(port, 32, duration_s, auth)
        return rps, round(rps * duration_s), "python (wrk missing)"
    with tempfile.TemporaryDirectory() as workdir:
        out, done = run_wrk(port, duration_s, wrk_script(Path(workdir) / "post.lua", auth), wrk)
    match = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if not match:
        raise RuntimeError(f"cannot read wrk output:\n{out}")
    return float(match.group(1)), done, "wrk -t1 -c32"


def _python_throughput(port: int, concurrency: int, duration_s: float, auth: str = "") -> float:
    async def worker(deadline: float, counts: list[int]) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        payload = _request_bytes(port, CHAT_BODY, auth)
        while time.perf_counter() < deadline:
            writer.write(payload)
            data = b""
            while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + int(
                re.search(rb"content-length: *(\d+)", data.lower()).group(1)  # type: ignore[union-attr]
            ):
                data += await reader.read(65536)
            counts[0] += 1
        writer.close()

    async def run() -> float:
        counts = [0]
        start = time.perf_counter()
        await asyncio.gather(*(worker(start + duration_s, counts) for _ in range(concurrency)))
        return counts[0] / (time.perf_counter() - start)

    return asyncio.run(run())


# ---- targets ---------------------------------------------------------------------------------


@dataclass
class Target:
    name: str
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path
    note: str = ""
    auth: str = ""  # a client key to send (Authorization: Bearer)

    def stop(self) -> None:
        stop_process_group(self.process)


def _start(
    name: str,
    argv: list[str],
    workdir: Path,
    env: dict[str, str] | None = None,
    *,
    port: int | None = None,
    port_pattern: str | None = None,
    timeout_s: float = 30.0,
    cwd: Path = ROOT,
) -> Target:
    """Start a process and learn its port from its output (or wait for a given port to answer)."""
    log_path = workdir / f"{name.replace('+', '_').replace(' ', '_')}.log"
    process = subprocess.Popen(
        argv,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        stdout=log_path.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )

    def listening_port() -> int | None:
        found = port
        if port_pattern:
            match = re.search(port_pattern, log_path.read_text(errors="replace"))
            found = int(match.group(1)) if match else None
        if found:
            try:
                with socket.create_connection(("127.0.0.1", found), timeout=0.5):
                    return found
            except OSError:
                pass
        return None

    try:
        ready_port = wait_until(
            listening_port,
            timeout_s,
            what=f"{name} listening",
            interval_s=0.1,
            process=process,
            describe=lambda: log_path.read_text(errors="replace")[-3000:],
        )
    except (RuntimeError, TimeoutError):
        stop_process_group(process, signal.SIGKILL)
        raise
    return Target(name, process, ready_port, log_path)


def _publish_policy(
    redis_url: str,
    prefix: str,
    upstreams: list[str],
    algorithm: str,
    version: int = 1,
    shadow: tuple[str, dict[str, Any]] | None = None,
) -> None:
    """Publish a snapshot with one node per mock upstream, as the control plane would; with
    ``shadow`` (algorithm, its params), a shadow policy running beside the live one (issue 23)."""
    import redis

    from routing.contract import PARAMS_BY_ALGORITHM, RedisKeys, RegionSpec
    from routing.writer import write
    from simulator.snapshots import make_node, make_snapshot

    keys = RedisKeys(prefix=prefix)
    nodes = tuple(
        make_node(
            i,
            upstream,
            name=f"mock-{i}",
            region="bench",
            models=(MODEL,),
            prefill_tokens_per_s=20_000.0,
            kv_capacity_tokens=1_000_000,
        )
        for i, upstream in enumerate(upstreams, start=1)
    )
    trial = None
    if shadow is not None:
        import msgspec

        from routing.contract import PolicySpec, TrialSpec

        shadow_params = msgspec.convert(shadow[1], PARAMS_BY_ALGORITHM[shadow[0]])
        trial = TrialSpec(
            id=1,
            kind="shadow",
            policy=PolicySpec(id=2, name="shadow", algorithm=shadow[0], params=shadow_params),
        )
    snapshot = make_snapshot(
        nodes,
        version=version,
        shadow=trial,
        params=PARAMS_BY_ALGORITHM[algorithm](),
        regions=(RegionSpec("bench", "Bench", 0.0, 0.0),),
        name="bench",
        checksum=uuid.uuid4().hex,
    )
    client = redis.Redis.from_url(redis_url)
    try:
        if not write(client, keys, snapshot):
            raise RuntimeError(f"Redis already holds a snapshot newer than version {version}")
    finally:
        client.close()


def _publish_bench_key(redis_url: str, prefix: str) -> None:
    """The one client key of the front-door target, as the control plane would write it."""
    import redis

    from routing.contract import SCHEMA_VERSION, ClientKeySet, ClientKeySpec, RedisKeys
    from routing.frontdoor.keystore import secret_hash
    from routing.writer import write

    key = ClientKeySpec(
        id="bench",
        secret_sha256=secret_hash(BENCH_SECRET),
        owner="bench",
        requests_per_min=1_000_000_000,
        tokens_per_min=1_000_000_000_000,
    )
    client = redis.Redis.from_url(redis_url)
    try:
        write(client, RedisKeys(prefix=prefix), ClientKeySet(SCHEMA_VERSION, 1, time.time(), (key,)))
    finally:
        client.close()


def _redis_cleanup(redis_url: str, prefix: str) -> int:
    import redis

    client = redis.Redis.from_url(redis_url)
    logged = client.xlen(f"{prefix}:requests")
    for key in client.scan_iter(match=f"{prefix}:*"):
        client.delete(key)
    return int(logged)


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def group_cpu_s(leader_pid: int, kind: str = "both") -> float:
    """CPU seconds (``user``, ``system`` or ``both``) of the live processes of ``leader_pid``'s group (/proc)."""
    total = sum(
        utime if kind == "user" else stime if kind == "system" else utime + stime
        for _, utime, stime in group_processes(leader_pid)
    )
    return total / os.sysconf("SC_CLK_TCK")


def measure(target: Target, args: argparse.Namespace) -> dict[str, Any]:
    pid = target.process.pid
    latencies = latency_c1(target.port, args.c1_requests, warmup=200, auth=target.auth)
    cpu_before, sys_before = group_cpu_s(pid), group_cpu_s(pid, "system")
    rps, done, loadgen = throughput_c32(target.port, args.c32_seconds, auth=target.auth)
    cpu_s = group_cpu_s(pid) - cpu_before
    sys_s = group_cpu_s(pid, "system") - sys_before
    per_client = args.stream_requests // 8
    ttfb_c1 = asyncio.run(stream_ttfb(target.port, 1, per_client, warmup=10, auth=target.auth))
    ttfb = asyncio.run(stream_ttfb(target.port, 8, per_client, warmup=10, auth=target.auth))
    result = {
        "p50_ms_c1": round(statistics.median(latencies), 4),
        "p99_ms_c1": round(_percentile(latencies, 0.99), 4),
        "rps_c32": round(rps, 1),
        "cpu_us_per_request": round(cpu_s / done * 1e6, 1) if done else None,
        "system_cpu_us_per_request": round(sys_s / done * 1e6, 1) if done else None,
        "rps_per_core": round(done / cpu_s) if cpu_s else None,
        "cpu_busy_c32": round(cpu_s / args.c32_seconds, 3),
        "stream_ttfb_p50_ms_c1": round(statistics.median(ttfb_c1), 4),
        "stream_ttfb_p50_ms_c8": round(statistics.median(ttfb), 4),
        "samples": {"c1": len(latencies), "c32": done, "stream_c1": len(ttfb_c1), "stream_c8": len(ttfb)},
        "loadgen_c32": loadgen,
    }
    if target.note:
        result["note"] = target.note
    print(f"  {target.name:<14} {result}", flush=True)
    return result


def _tracing_off_ns(loops: int = 2_000_000) -> float:
    """What the request path's tracing hooks cost while tracing is off, in ns per request.

    The hooks in routing/proxy/ (handler, relay, outcome) are one slot store (``exchange.span = None``) and three
    ``is not None`` tests; timed here on the same kinds of objects, minus an empty call. Unlike
    the end-to-end rows this does not depend on what else the machine runs.
    """
    import timeit

    class Exchange:
        __slots__ = ("span",)

    class Proxy:
        def __init__(self) -> None:
            self._tracing = None

    proxy, exchange = Proxy(), Exchange()

    def hooks() -> None:
        exchange.span = None
        if proxy._tracing is not None:
            raise AssertionError
        if exchange.span is not None:
            raise AssertionError
        if exchange.span is not None:
            raise AssertionError

    def empty() -> None:
        pass

    best = min(timeit.repeat(hooks, number=loops, repeat=5)) - min(
        timeit.repeat(empty, number=loops, repeat=5)
    )
    return max(best, 0.0) / loops * 1e9


def _tracing_on_cpu_us(requests: int = 5000) -> float:
    """CPU per request of a traced request's span work in-process (start with a traceparent, read
    the answer, finish from a request record, export in batches to a no-op exporter), in µs.

    Process CPU time, so it depends less on what else the machine runs than the rows above.
    """
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    from routing.contract import SCHEMA_VERSION, CostTerms, RequestRecord
    from routing.observability.tracing import GatewayTracing
    from simulator.snapshots import make_node

    class Discard(SpanExporter):
        def export(self, spans):  # the batches are built, only the network is left out
            return SpanExportResult.SUCCESS

    tracing = GatewayTracing.with_processor(BatchSpanProcessor(Discard()), region="bench", gateway_id="bench")
    scope_headers = [(b"traceparent", b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")]
    answer = json.dumps(
        {"id": "chatcmpl-1", "model": MODEL, "choices": [{"index": 0, "finish_reason": "stop"}]}
    ).encode()
    cost = CostTerms(node_id=1, total_ms=40.0, rtt_ms=10.0, queue_ms=5.0, prefill_ms=25.0, matched_tokens=64)
    record = RequestRecord(
        schema_version=SCHEMA_VERSION, request_id="r", ts=time.time(), gateway_region="bench",
        gateway_id="bench", model=MODEL, status=200, stream=False, node_id=1, node_region="bench",
        algorithm="gorgo", policy_version=1, prompt_tokens=12, completion_tokens=8, cost=cost, runner_up=cost,
    )  # fmt: skip
    node = make_node(1, name="mock-1", region="bench", models=(MODEL,))
    started = time.process_time()
    for _ in range(requests):
        headers = [(b"Content-Type", b"application/json")]
        span = tracing.start(scope_headers, headers, "chat", CHAT_BODY, time.time())
        tracing.answer(span, answer, stream=False)
        tracing.finish(span, record, node)
    tracing.shutdown()  # the batch exports count too
    return (time.process_time() - started) / requests * 1e6


def _machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {}
    for package in ("uvicorn", "uvloop", "httptools", "aiohttp", "httpx", "vllm-router"):
        try:
            from importlib.metadata import version

            versions[package] = version(package)
        except Exception:
            continue
    return {
        "cpu": model or platform.processor(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": versions,
    }


def _policy_swap_ms(
    redis_url: str, prefix: str, upstreams: list[str], algorithm: str, port: int
) -> list[float]:
    """Publish new versions and time until the gateway serves each (polling /healthz)."""
    samples = []
    for version in range(2, 7):
        start = time.perf_counter()
        _publish_policy(redis_url, prefix, upstreams, algorithm, version=version)
        deadline = start + 5.0
        while time.perf_counter() < deadline:
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
                answer = b""
                while chunk := sock.recv(65536):
                    answer += chunk
            if b'"policy_version":%d' % version in answer:
                samples.append((time.perf_counter() - start) * 1000)
                break
            time.sleep(0.001)
    return samples


def start_mocks(workdir: Path) -> list[Any]:
    """The ``UPSTREAMS`` no-delay mock nodes every gateway benchmark routes to (``overhead_servers.py mock``)."""
    return [
        _start(f"mock-{i}", [sys.executable, SERVERS, "mock"], workdir, port_pattern=r"READY (\d+)")
        for i in range(UPSTREAMS)
    ]


def router_in(checkouts: list[Path]) -> Path:
    """The Rust router's binary in the first of ``checkouts``' virtualenvs that has it (SystemExit if none)."""
    found = [checkout / ".venv" / "bin" / "vllm-router" for checkout in checkouts]
    router = next((path for path in found if path.exists()), None)
    if router is None:
        raise SystemExit("--router: no variant's .venv has vllm-router (pip install -e '.[peers]')")
    return router


def _vllm_router() -> str | None:
    """The Rust router's launcher, if ``pip install vllm-router`` put it in this environment."""
    beside_python = Path(sys.executable).parent / "vllm-router"
    return str(beside_python) if beside_python.exists() else shutil.which("vllm-router")


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, median, q3


def rounds_in_turns(
    targets: tuple[Target, ...], rounds: int, seconds: float, c1_requests: int, stream_requests: int = 0
) -> list[dict[str, dict[str, float]]]:
    """Figures of targets that are up together and take turns, per round: ``seconds`` of wrk at
    32 connections against each in turn (the order rotates every round; CPU per request from
    /proc), then ``c1_requests`` sequential requests to each, taking turns request by request,
    then (``stream_requests``) that many streams from one client to each in turn (TTFB p50)."""
    per_round: list[dict[str, dict[str, float]]] = []
    for index in range(rounds):
        figures: dict[str, dict[str, float]] = {}
        shift = index % len(targets)
        for target in targets[shift:] + targets[:shift]:
            pid = target.process.pid
            cpu_before = group_cpu_s(pid)
            rps, done, _ = throughput_c32(target.port, seconds, auth=target.auth)
            cpu_s = group_cpu_s(pid) - cpu_before
            figures[target.name] = {"rps_c32": rps, "cpu_us_per_request": cpu_s / done * 1e6}
        turns = latency_c1_interleaved([(each.port, each.auth) for each in targets], c1_requests, 50)
        for target, latencies in zip(targets, turns, strict=True):
            figures[target.name]["p50_ms_c1"] = statistics.median(latencies)
        if stream_requests:
            for target in targets[shift:] + targets[:shift]:
                ttfb = asyncio.run(stream_ttfb(target.port, 1, stream_requests, warmup=5, auth=target.auth))
                figures[target.name]["stream_ttfb_p50_ms_c1"] = statistics.median(ttfb)
        per_round.append(figures)
        print(
            f"    round {index + 1}/{rounds}: "
            + ", ".join(
                f"{name} {each['cpu_us_per_request']:.0f} µs/req, p50 {each['p50_ms_c1']:.3f} ms"
                for name, each in figures.items()
            ),
            flush=True,
        )
    return per_round


def _threads(pid: int) -> int:
    """How many threads the process runs (its tokio workers, plus the main thread)."""
    return len(os.listdir(f"/proc/{pid}/task"))


def paced_workers(
    one: Target, two: Target, rates: list[float], rounds: int, seconds: float
) -> dict[str, Any]:
    """CPU per request of ``two`` (``--workers 2``) against ``one`` at paced loads below saturation:
    per rate, ``rounds`` rounds of ``seconds`` of wrk -c32 against each in turn, every connection
    waiting after each answer so the 32 together offer about that many requests a second. At
    saturation the workers share the two cores with wrk and the nodes; paced, the cores have room,
    so what is left of the ratio is the second process's own cost."""
    wrk = shutil.which("wrk")
    if wrk is None:
        return {"error": "wrk is not installed"}
    out: dict[str, Any] = {}
    idle: dict[str, float] = {}
    for target in (one, two):  # what each costs with no traffic at all: its background loops
        before = group_cpu_s(target.process.pid)
        time.sleep(seconds * 2)
        idle[target.name] = round((group_cpu_s(target.process.pid) - before) / (seconds * 2) * 1000, 1)
    out["idle_cpu_ms_per_s"] = idle
    print(f"    idle CPU, ms a second: {idle}", flush=True)
    with tempfile.TemporaryDirectory() as workdir:
        for rate in rates:
            delay_ms = max(32_000.0 / rate - 0.3, 0.1)  # 32 connections, ~0.3 ms an answer
            ratios: list[float] = []
            achieved: dict[str, list[float]] = {one.name: [], two.name: []}
            cpu_us: dict[str, list[float]] = {one.name: [], two.name: []}
            for index in range(rounds):
                cpu: dict[str, float] = {}
                for target in (one, two) if index % 2 == 0 else (two, one):
                    script = wrk_script(Path(workdir) / f"paced-{target.port}.lua", target.auth, delay_ms)
                    before = group_cpu_s(target.process.pid)
                    _, done = run_wrk(target.port, seconds, script, wrk)
                    cpu[target.name] = (group_cpu_s(target.process.pid) - before) / done * 1e6
                    achieved[target.name].append(done / seconds)
                    cpu_us[target.name].append(cpu[target.name])
                ratios.append(cpu[two.name] / cpu[one.name])
            q1, median, q3 = _quartiles(ratios) if len(ratios) > 1 else (ratios[0],) * 3
            out[f"{rate:g}"] = {
                "cpu_per_request_x2_vs_x1": round(median, 4),
                "iqr": [round(q1, 4), round(q3, 4)],
                "rps": {name: round(statistics.median(values)) for name, values in achieved.items()},
                "cpu_us_per_request": {name: round(statistics.median(v), 1) for name, v in cpu_us.items()},
                "rounds": [round(r, 4) for r in ratios],
            }
            print(
                f"    paced ~{rate:g}/s: x2/x1 CPU per request {median:.3f} ({q1:.3f}-{q3:.3f})", flush=True
            )
    return out


def router_turns(
    router: Target,
    gateways: tuple[Target, ...],
    rounds: int,
    seconds: float,
    c1_requests: int,
    router_one_thread: Target | None = None,
) -> dict[str, Any]:
    """Issue 25's targets judged on rounds taken in turns with the Rust router (all up together):
    per round each gateway's requests per core as a ratio to the router's (the router's CPU per
    request over the gateway's) and its p50 at one client minus the router's; medians and IQRs
    over the rounds. CPU per request of each gateway against the first one's too (workers: x2
    against x1). With ``router_one_thread`` (the same router on one tokio worker thread) in the
    turns too, the router's own CPU per request on its default threads against one: what a second
    core's worth of workers costs the peer, measured beside gorgo's second worker."""
    measured = (router, *gateways) + ((router_one_thread,) if router_one_thread is not None else ())
    per_round = rounds_in_turns(measured, rounds, seconds, c1_requests, stream_requests=60)
    summary: dict[str, Any] = {}
    if router_one_thread is not None:
        ratios = [
            each[router.name]["cpu_us_per_request"] / each[router_one_thread.name]["cpu_us_per_request"]
            for each in per_round
        ]
        q1, median, q3 = _quartiles(ratios) if len(ratios) > 1 else (ratios[0],) * 3
        summary["router_threads"] = {
            "cpu_per_request_default_vs_one_thread": round(median, 4),
            "iqr": [round(q1, 4), round(q3, 4)],
            "threads": {
                router.name: _threads(router.process.pid),
                router_one_thread.name: _threads(router_one_thread.process.pid),
            },
        }
    first = gateways[0].name
    for gateway in gateways:
        series = {
            "rps_per_core_vs_router": [
                each[router.name]["cpu_us_per_request"] / each[gateway.name]["cpu_us_per_request"]
                for each in per_round
            ],
            "p50_ms_c1_minus_router": [
                each[gateway.name]["p50_ms_c1"] - each[router.name]["p50_ms_c1"] for each in per_round
            ],
            "stream_ttfb_ms_c1_minus_router": [
                each[gateway.name]["stream_ttfb_p50_ms_c1"] - each[router.name]["stream_ttfb_p50_ms_c1"]
                for each in per_round
            ],
            "cpu_per_request_vs_first": [
                each[gateway.name]["cpu_us_per_request"] / each[first]["cpu_us_per_request"]
                for each in per_round
            ],
        }
        figures: dict[str, Any] = {}
        for name, values in series.items():
            q1, median, q3 = _quartiles(values) if len(values) > 1 else (values[0],) * 3
            figures[name] = round(median, 4)
            figures[f"{name}_iqr"] = [round(q1, 4), round(q3, 4)]
        summary[gateway.name] = figures
    summary["rounds"] = [
        {name: {key: round(value, 4) for key, value in each.items()} for name, each in figures.items()}
        for figures in per_round
    ]
    summary["method"] = (
        f"{rounds} rounds, {', '.join(t.name for t in (router, *gateways))} up together; each round "
        f"{seconds:g} s of wrk -c32 per target (the order rotates), then {c1_requests} sequential requests "
        "to each, taking turns request by request; medians (IQR) over the rounds"
    )
    return summary


def pairs_in_turns(
    plain: Target, twin: Target, front: Target, rounds: int, seconds: float, c1_requests: int
) -> dict[str, Any]:
    """What a feature costs, from rounds in which three gateways take turns: the plain gateway,
    its identical twin and the gateway with the feature on (``front``: the front door, or a shadow).

    One long run per target lets the machine's drift decide the comparison (this machine is
    shared: identical gorgo targets measured minutes apart have differed by 45 %). Here all three
    are up at once. A round: ``seconds`` of wrk at 32 connections against each in turn (the order
    rotates every round; CPU per request from /proc), then ``c1_requests`` sequential requests to
    each, taking turns request by request (the p50s). Every round gives each gateway's ratio to
    the plain one; the figure is the median over the rounds. The twin is the noise floor: it runs
    the same code as the plain gateway, so its spread around 1.0 is what this machine can resolve.
    """
    per_round: list[dict[str, dict[str, float]]] = []
    for figures in rounds_in_turns((plain, twin, front), rounds, seconds, c1_requests):
        base = figures[plain.name]
        per_round.append(
            {
                other.name: {
                    "rps_c32_ratio": round(figures[other.name]["rps_c32"] / base["rps_c32"], 4),
                    "rps_per_core_ratio": round(
                        base["cpu_us_per_request"] / figures[other.name]["cpu_us_per_request"], 4
                    ),
                    "added_cpu_us_per_request": round(
                        figures[other.name]["cpu_us_per_request"] - base["cpu_us_per_request"], 1
                    ),
                    "added_p50_ms_c1": round(figures[other.name]["p50_ms_c1"] - base["p50_ms_c1"], 4),
                }
                for other in (twin, front)
            }
        )
    summary: dict[str, Any] = {}
    for other in (twin, front):
        figures_of = {}
        for name in per_round[0][other.name]:
            q1, median, q3 = _quartiles([each[other.name][name] for each in per_round])
            figures_of[name] = round(median, 4)
            figures_of[f"{name}_iqr"] = [round(q1, 4), round(q3, 4)]
        summary[other.name] = figures_of
    summary["rounds"] = per_round
    summary["method"] = (
        f"{rounds} rounds, the plain gateway, its twin and {front.name} up together; each round "
        f"{seconds:g} s of wrk -c32 per gateway (the order rotates), then {c1_requests} sequential requests "
        "to each, taking turns request by request; figures are medians over the rounds of each round's "
        "ratio or difference to the plain gateway"
    )
    return summary


def shadow_pairs(gorgo: Any, args: argparse.Namespace, redis_url: str, prefixes: list[str]) -> dict[str, Any]:
    """Issue 23's budget, the shadow's CPU per request: ``gorgo``, its twin and ``gorgo+shadow``
    (the same snapshot with a shadow policy beside the live one) take turns (``pairs_in_turns``)."""
    shadow = (args.shadow, json.loads(args.shadow_params))
    print(
        f"  shadow: {args.pair_rounds} rounds, taking turns with the plain gateway and its twin", flush=True
    )
    gateways: list[Target] = []
    try:
        for name, with_shadow in (("gorgo", False), ("gorgo twin", False), ("gorgo+shadow", True)):
            gateways.append(gorgo(args.algorithm, shadow=shadow if with_shadow else None))
            gateways[-1].name = name
        for target in gateways:  # warm them up alike
            latency_c1(target.port, 500, warmup=0, auth=target.auth)
        pairs = pairs_in_turns(*gateways, args.pair_rounds, args.pair_seconds, min(500, args.c1_requests))
        _check_shadow_logged(redis_url, prefixes[-1])
    except Exception as exc:
        print(f"  shadow pairs: failed: {exc}", flush=True)
        return {"error": str(exc)[:500]}
    finally:
        for target in gateways:
            target.stop()
    pairs["setup"] = gateways[-1].note
    pairs["budget"] = {
        "value": pairs["gorgo+shadow"]["added_cpu_us_per_request"],
        "max": SHADOW_BUDGET_US,
        "met": pairs["gorgo+shadow"]["added_cpu_us_per_request"] <= SHADOW_BUDGET_US,
    }
    return pairs


def _check_shadow_logged(redis_url: str, prefix: str) -> None:
    """The shadow gateway really ran its shadow: its last request record names the shadow's node."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        entries = client.xrevrange(f"{prefix}:requests", count=1)
    finally:
        client.close()
    if not entries or not any(
        b'"shadow_node_id":' in value and b'"shadow_node_id":null' not in value
        for value in entries[0][1].values()
    ):
        raise RuntimeError(f"the shadow gateway logged no shadow decision: {entries[:1]!r}"[:300])


def _shadow_markdown(report: dict[str, Any]) -> str:
    pairs = report["shadow_pairs"]
    lines = [
        "# The shadow's cost in the gateway (issue 23)",
        "",
        f"`{report['command']}` on {report['machine']['cpus']} CPUs, load average "
        f"{report['machine']['load_average']}. {pairs['method']}. The twin runs the same code as the plain "
        "gateway: its column is this machine's noise. CPU per request is the gateway process group's user + "
        "system time over each wrk run, divided by the requests it completed (a mean, not a p50).",
        "",
        f"Gateways: {pairs['setup']}.",
        "",
        "| figure (against the plain gateway) | shadow on: median (IQR) | budget | met | twin: median (IQR) |",
        "|---|---:|---:|---|---:|",
    ]
    for name, label in (
        ("added_cpu_us_per_request", "added CPU per request (µs)"),
        ("rps_per_core_ratio", "req/s per core ratio"),
        ("rps_c32_ratio", "throughput c32 ratio"),
        ("added_p50_ms_c1", "added p50 c1 (ms)"),
    ):

        def cell(figures: dict[str, Any], name: str = name) -> str:
            low, high = figures[f"{name}_iqr"]
            return f"{figures[name]:g} ({low:g} to {high:g})"

        budget = pairs["budget"]
        bound, met = ("", "")
        if name == "added_cpu_us_per_request":
            bound, met = f"≤ {budget['max']:g}", "yes" if budget["met"] else "**no**"
        lines.append(
            f"| {label} | {cell(pairs['gorgo+shadow'])} | {bound} | {met} | {cell(pairs['gorgo twin'])} |"
        )
    low, high = pairs["gorgo twin"]["added_cpu_us_per_request_iqr"]
    if high - low > pairs["budget"]["max"]:
        lines += [
            "",
            f"Inconclusive on this run: the twin's interquartile range of added CPU ({low:g} to {high:g} µs) is "
            f"wider than the budget, so this machine could not resolve {pairs['budget']['max']:g} µs here; "
            "benchmarks/shadow_cost.py measures the same work in-process on the thread's CPU clock.",
        ]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> dict[str, Any]:
    python = sys.executable
    workdir = Path(tempfile.mkdtemp(prefix="gorgo-bench-"))
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    prefixes: list[str] = []
    results: dict[str, Any] = {}
    extras: dict[str, Any] = {}
    uvicorn_port = r"Uvicorn running on http://127\.0\.0\.1:(\d+)"
    # A baseline checkout from before issue 25 still runs on uvicorn.
    gorgo_port = r"(?:listening on|Uvicorn running on) http://127\.0\.0\.1:(\d+)"
    mocks = start_mocks(workdir)
    mock = mocks[0]
    upstreams = [f"http://127.0.0.1:{m.port}" for m in mocks]

    helpers: list[Target] = []

    def gorgo(
        algorithm: str,
        front_door: bool = False,
        tracing: bool = False,
        workers: int = 1,
        shadow: tuple[str, dict[str, Any]] | None = None,
        checkout: Path | None = None,
    ) -> Target:
        prefix = f"gorgobench-{uuid.uuid4().hex[:12]}"
        prefixes.append(prefix)
        _publish_policy(redis_url, prefix, upstreams, algorithm, shadow=shadow)
        if front_door:
            _publish_bench_key(redis_url, prefix)
        env = {
            "REDIS_URL": redis_url,
            "GORGO_REDIS_PREFIX": prefix,
            "LOG_LEVEL": "info",
            "GORGO_AUTH": "on" if front_door else "off",
            "OTEL_EXPORTER_OTLP_ENDPOINT": "",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "",
        }
        if tracing:
            sink = _start("otlp-sink", [python, SERVERS, "mock"], workdir, port_pattern=r"READY (\d+)")
            helpers.append(sink)
            env.update(
                {
                    "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink.port}",
                    "OTEL_SERVICE_NAME": "gorgo-bench",
                    "OTEL_TRACES_SAMPLER": "always_on",
                }
            )
        suffix = ("-frontdoor" if front_door else "") + ("-tracing" if tracing else "")
        interpreter = python if checkout is None else str(checkout / ".venv" / "bin" / "python")
        target = _start(
            f"gorgo-{algorithm}{suffix}-x{workers}" + ("-baseline" if checkout else ""),
            [interpreter, "-m", "routing", "--port", "0", "--region", "bench", "--workers", str(workers)],
            workdir,
            env,
            port_pattern=gorgo_port,
            cwd=checkout or ROOT,
        )
        wait_until(  # every worker listening, not just the first
            lambda: len(re.findall(gorgo_port, target.log_path.read_text(errors="replace"))) >= workers,
            30.0,
            what=f"{workers} workers listening",
        )
        target.note = f"policy {algorithm}, {len(upstreams)} nodes, {workers} worker(s), request log on"
        if front_door:
            target.auth = BENCH_SECRET
            target.note += ", auth + rate limits on (one key)"
        if tracing:
            target.note += ", tracing on (every request)"
        if shadow is not None:
            target.note += f", shadow {shadow[0]} {json.dumps(shadow[1])}"
        return target

    plan: list[tuple[str, Any]] = [
        ("direct", lambda: mock),
        ("gorgo+frontdoor", lambda: gorgo(args.algorithm, front_door=True)),
        ("gorgo", lambda: gorgo(args.algorithm)),
        ("gorgo+frontdoor x2", lambda: gorgo(args.algorithm, front_door=True, workers=2)),
        ("gorgo+tracing", lambda: gorgo(args.algorithm, tracing=True)),
    ]
    if args.baseline:
        plan.insert(
            2,
            (
                "gorgo+frontdoor baseline",
                lambda: gorgo(args.algorithm, front_door=True, checkout=args.baseline),
            ),
        )
    router = _vllm_router()
    if not args.skip_peers:
        if router is None:
            results["vllm-router"] = {
                "error": "not installed (pip install -e '.[peers]' failed or was not run)"
            }
        else:
            port = free_port()
            argv = [router, "--worker-urls", *upstreams, "--policy", "round_robin", "--host", "127.0.0.1"]
            argv += ["--port", str(port), "--log-level", "warning"]
            plan.append(
                ("vllm-router", lambda argv=argv, port=port: _start("vllm-router", argv, workdir, port=port))
            )
        for kind in ("aiohttp", "httpx") if args.with_httpx else ("aiohttp",):
            argv = [python, SERVERS, "proxy", kind]
            for upstream in upstreams:
                argv += ["--upstream", upstream]
            plan.append(
                (
                    f"asgi+{kind}",
                    lambda argv=argv, kind=kind: _start(
                        f"asgi+{kind}", argv, workdir, port_pattern=uvicorn_port
                    ),
                )
            )
    if args.shadow:
        plan = []  # the shadow's comparison only (below): the table's targets are not run
    try:
        if args.shadow:
            extras["shadow_pairs"] = shadow_pairs(gorgo, args, redis_url, prefixes)
        for name, starter in plan:
            if args.only and name not in args.only and name != "direct":
                continue
            try:
                target = starter()
            except Exception as exc:  # a peer that does not start is reported, the run goes on
                print(f"  {name}: did not start: {exc}", flush=True)
                results[name] = {"error": f"did not start: {str(exc)[:300]}"}
                continue
            target.name = name
            try:
                results[name] = measure(target, args)
                if name == "gorgo":
                    swaps = _policy_swap_ms(redis_url, prefixes[-1], upstreams, args.algorithm, target.port)
                    extras["policy_swap_ms"] = {
                        "samples": [round(v, 2) for v in swaps],
                        "max": round(max(swaps), 2),
                    }
                    print(f"  policy swap (publish -> served): {extras['policy_swap_ms']}", flush=True)
            except Exception as exc:  # a peer that fails is reported, the run goes on
                print(f"  {name}: failed: {exc}", flush=True)
                results[name] = {"error": str(exc)[:500]}
            finally:
                if target is not mock:
                    target.stop()
        if args.router_rounds and router is not None and not args.skip_peers:
            print(f"  issue 25: {args.router_rounds} rounds taking turns with the Rust router", flush=True)
            together: list[Target] = []
            try:
                port = free_port()
                argv = [router, "--worker-urls", *upstreams, "--policy", "round_robin", "--host", "127.0.0.1"]
                together.append(
                    _start(
                        "vllm-router",
                        [*argv, "--port", str(port), "--log-level", "warning"],
                        workdir,
                        port=port,
                    )
                )
                gateways = [
                    ("gorgo+frontdoor", lambda: gorgo(args.algorithm, front_door=True)),
                    ("gorgo+frontdoor x2", lambda: gorgo(args.algorithm, front_door=True, workers=2)),
                ]
                if args.baseline:
                    gateways.append(
                        (
                            "gorgo+frontdoor baseline",
                            lambda: gorgo(args.algorithm, front_door=True, checkout=args.baseline),
                        )
                    )
                for name, starter in gateways:
                    together.append(starter())
                    together[-1].name = name
                together[0].name = "vllm-router"
                # The peer on one tokio worker thread (its default is one per core): its own cost
                # of a second worker, beside gorgo's --workers 2.
                port = free_port()
                one_thread = _start(
                    "vllm-router-1-thread",
                    [
                        *argv,
                        "--port",
                        str(port),
                        "--prometheus-port",
                        str(free_port()),
                        "--log-level",
                        "warning",
                    ],
                    workdir,
                    {"TOKIO_WORKER_THREADS": "1"},
                    port=port,
                )
                together.append(one_thread)
                one_thread.name = "vllm-router 1 thread"
                for target in together:  # warm them up alike
                    latency_c1(target.port, 500, warmup=0, auth=target.auth)
                extras["router_turns"] = router_turns(
                    together[0],
                    tuple(together[1:-1]),
                    args.router_rounds,
                    args.pair_seconds,
                    min(500, args.c1_requests),
                    router_one_thread=one_thread,
                )
            except Exception as exc:
                print(f"  router turns: failed: {exc}", flush=True)
                extras["router_turns"] = {"error": str(exc)[:500]}
            finally:
                for target in together:
                    target.stop()
        if args.paced_rates and not args.shadow:
            rates = [float(rate) for rate in args.paced_rates.split(",") if rate.strip()]
            print(f"  workers: x2 against x1 at paced loads {rates} req/s", flush=True)
            paced: list[Target] = []
            try:
                for name, workers in (("gorgo+frontdoor", 1), ("gorgo+frontdoor x2", 2)):
                    paced.append(gorgo(args.algorithm, front_door=True, workers=workers))
                    paced[-1].name = name
                for target in paced:  # warm them up alike
                    latency_c1(target.port, 500, warmup=0, auth=target.auth)
                extras["workers_paced"] = paced_workers(
                    paced[0], paced[1], rates, args.paced_rounds, args.pair_seconds * 2
                )
            except Exception as exc:
                print(f"  paced workers: failed: {exc}", flush=True)
                extras["workers_paced"] = {"error": str(exc)[:500]}
            finally:
                for target in paced:
                    target.stop()
        wanted = {"gorgo", "gorgo+frontdoor"}
        if args.pair_rounds and not args.shadow and (not args.only or wanted <= set(args.only)):
            print(
                f"  front door: {args.pair_rounds} rounds, taking turns with the plain gateway and its twin",
                flush=True,
            )
            pair: list[Target] = []
            try:
                for name, front_door in (("gorgo", False), ("gorgo twin", False), ("gorgo+frontdoor", True)):
                    pair.append(gorgo(args.algorithm, front_door=front_door))
                    pair[-1].name = name
                for target in pair:  # warm them up alike
                    latency_c1(target.port, 500, warmup=0, auth=target.auth)
                extras["front_door_pairs"] = pairs_in_turns(
                    *pair, args.pair_rounds, args.pair_seconds, min(500, args.c1_requests)
                )
            except Exception as exc:
                print(f"  front door pairs: failed: {exc}", flush=True)
                extras["front_door_pairs"] = {"error": str(exc)[:500]}
            finally:
                for target in pair:
                    target.stop()
    finally:
        for each in mocks + helpers:
            each.stop()
    if any("error" in figures for figures in results.values()):
        print(f"  process logs kept in {workdir}", flush=True)
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    logged = 0
    for prefix in prefixes:
        try:
            logged += _redis_cleanup(redis_url, prefix)
        except Exception:
            pass
    return {"results": results, "request_log_records": logged, "extras": extras}


def _added(targets: dict[str, Any]) -> dict[str, Any]:
    direct = targets.get("direct", {})
    added: dict[str, Any] = {}
    for name, figures in targets.items():
        if name == "direct" or "error" in figures or "error" in direct or not direct:
            continue
        added[name] = {
            key: round(figures[key] - direct[key], 4)
            for key in ("p50_ms_c1", "p99_ms_c1", "stream_ttfb_p50_ms_c1", "stream_ttfb_p50_ms_c8")
        }
    return added


def _targets_vs_router(targets: dict[str, Any], added: dict[str, Any]) -> dict[str, Any]:
    """Issue 15: the headline gorgo (front door on) against the Rust router, from this run."""
    ours, router = targets.get("gorgo+frontdoor", {}), targets.get("vllm-router", {})
    if "error" in ours or "error" in router or not ours or not router or "gorgo+frontdoor" not in added:
        return {}
    a, r = added["gorgo+frontdoor"], added["vllm-router"]
    rows = {
        "rps_per_core": (
            ours["rps_per_core"],
            router["rps_per_core"],
            ours["rps_per_core"] >= router["rps_per_core"],
        ),
        "added_p50_ms_c1": (a["p50_ms_c1"], r["p50_ms_c1"], a["p50_ms_c1"] <= r["p50_ms_c1"]),
        "added_p99_ms_c1": (a["p99_ms_c1"], 1.5 * r["p99_ms_c1"], a["p99_ms_c1"] <= 1.5 * r["p99_ms_c1"]),
        "added_stream_ttfb_ms_c1": (
            a["stream_ttfb_p50_ms_c1"],
            r["stream_ttfb_p50_ms_c1"],
            a["stream_ttfb_p50_ms_c1"] <= r["stream_ttfb_p50_ms_c1"],
        ),
        "added_stream_ttfb_ms_c8": (
            a["stream_ttfb_p50_ms_c8"],
            r["stream_ttfb_p50_ms_c8"],
            a["stream_ttfb_p50_ms_c8"] <= r["stream_ttfb_p50_ms_c8"],
        ),
    }
    return {
        name: {"gorgo": round(value, 4), "target": round(limit, 4), "met": met}
        for name, (value, limit, met) in rows.items()
    }


def _markdown(report: dict[str, Any]) -> str:
    targets, added = report["targets"], report["added"]
    lines = [
        "# Gateway overhead",
        "",
        f"Generated by `python benchmarks/gateway_overhead.py` on {report['generated_at']}; "
        f"{report['machine']['cpus']} CPUs ({report['machine']['cpu']}), Python {report['machine']['python']}. "
        f"{UPSTREAMS} no-delay mock OpenAI backends (one process each); all targets measured in the same run. "
        "Added = minus a direct call to one mock. CPU = user + system time of the target's processes "
        "during the c32 run, per request.",
        "",
        "| target | added p50 / p99 c1 (ms) | req/s c32 | CPU µs/request (of it kernel) | req/s per core | added stream TTFB c1 / c8 (ms) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, figures in targets.items():
        if "error" in figures:
            lines.append(f"| {name} | {figures['error'][:90]} | | | | |")
            continue
        extra = added.get(name)
        if extra:
            c1 = f"{extra['p50_ms_c1']:+.3f} / {extra['p99_ms_c1']:+.3f}"
            ttfb = f"{extra['stream_ttfb_p50_ms_c1']:+.3f} / {extra['stream_ttfb_p50_ms_c8']:+.3f}"
        else:
            c1 = f"{figures['p50_ms_c1']:.3f} / {figures['p99_ms_c1']:.3f} (absolute)"
            ttfb = (
                f"{figures['stream_ttfb_p50_ms_c1']:.3f} / {figures['stream_ttfb_p50_ms_c8']:.3f} (absolute)"
            )
        lines.append(
            f"| {name} | {c1} | {figures['rps_c32']:,.0f} | {figures['cpu_us_per_request'] or 0:,.1f} "
            f"({figures['system_cpu_us_per_request'] or 0:,.1f}) | "
            f"{figures['rps_per_core'] or 0:,} | {ttfb} |"
        )
    checks = report["targets_vs_router"]
    lines += ["", "Issue 15 targets, `gorgo+frontdoor` against `vllm-router` in this run:", ""]
    if checks:
        lines += ["| figure | gorgo+frontdoor | target | met |", "|---|---:|---:|---|"]
        labels = {
            "rps_per_core": "req/s per core (≥ router)",
            "added_p50_ms_c1": "added p50 c1, ms (≤ router)",
            "added_p99_ms_c1": "added p99 c1, ms (≤ 1.5 x router)",
            "added_stream_ttfb_ms_c1": "added stream TTFB c1, ms (≤ router)",
            "added_stream_ttfb_ms_c8": "added stream TTFB c8, ms (≤ router)",
        }
        for name, row in checks.items():
            lines.append(
                f"| {labels[name]} | {row['gorgo']:,} | {row['target']:,} | {'yes' if row['met'] else '**no**'} |"
            )
    else:
        lines.append("Not checked: a target is missing from this run.")
    turns = report.get("router_turns")
    if turns and "error" not in turns:
        names = [name for name in turns if name not in ("rounds", "method", "router_threads")]

        def cell(name: str, figure: str) -> str:
            low, high = turns[name][f"{figure}_iqr"]
            return f"{turns[name][figure]:g} ({low:g} to {high:g})"

        lines += [
            "",
            f"Issue 25 targets, on rounds taken in turns with the Rust router ({turns['method']}):",
            "",
            "| figure | " + " | ".join(names) + " | target | met (`gorgo+frontdoor`) |",
            "|---|" + "---:|" * len(names) + "---|---|",
        ]
        ours = turns.get("gorgo+frontdoor", {})
        rows = (
            ("rps_per_core_vs_router", "req/s per core, x the router's", "≥ 1.0", lambda v: v >= 1.0),
            ("p50_ms_c1_minus_router", "p50 c1 minus the router's (ms)", "≤ 0", lambda v: v <= 0),
            (
                "stream_ttfb_ms_c1_minus_router",
                "stream TTFB c1 minus the router's (ms)",
                "≤ 0",
                lambda v: v <= 0,
            ),
            ("cpu_per_request_vs_first", "CPU per request, x `gorgo+frontdoor`'s", "x2: ≤ 1.1", None),
        )
        for figure, label, bound, ok in rows:
            met = "" if ok is None or figure not in ours else ("yes" if ok(ours[figure]) else "**no**")
            lines.append(
                f"| {label} | " + " | ".join(cell(n, figure) for n in names) + f" | {bound} | {met} |"
            )
        x2 = turns.get("gorgo+frontdoor x2")
        if x2:
            met = "yes" if x2["cpu_per_request_vs_first"] <= 1.1 else "**no**"
            lines.append("")
            lines.append(
                f"Workers: CPU per request of `--workers 2` against 1, in turns: x{x2['cpu_per_request_vs_first']:g} "
                f"(target ≤ 1.1: {met})."
            )
        threads = turns.get("router_threads")
        if threads:
            low, high = threads["iqr"]
            lines.append(
                "The Rust router in the same turns, on its default tokio worker threads against one "
                f"(threads {threads['threads']}): CPU per request x{threads['cpu_per_request_default_vs_one_thread']:g} "
                f"({low:g} to {high:g}). Its threads share one process; gorgo's workers are processes."
            )
    elif turns:
        lines += ["", f"Rounds with the Rust router failed: {turns['error']}"]
    paced = report.get("workers_paced")
    if paced and "error" not in paced:
        lines += [
            "",
            "Workers at paced loads (`--paced-rates`; wrk -c32, every connection waiting after each answer; "
            "rounds in turns): CPU per request of `--workers 2` against 1",
            "",
            "| offered req/s | x2 / x1 (median, IQR) | achieved req/s x1 / x2 | CPU µs/request x1 / x2 |",
            "|---:|---:|---:|---:|",
        ]
        idle = paced.get("idle_cpu_ms_per_s", {})
        for rate, figures in paced.items():
            if rate == "idle_cpu_ms_per_s":
                continue
            rps = list(figures["rps"].values())
            cpu = list(figures["cpu_us_per_request"].values())
            lines.append(
                f"| {rate} | {figures['cpu_per_request_x2_vs_x1']:.3f} ({figures['iqr'][0]:.3f}-"
                f"{figures['iqr'][1]:.3f}) | {rps[0]:,} / {rps[1]:,} | {cpu[0]:g} / {cpu[1]:g} |"
            )
        if idle:
            values = list(idle.values())
            lines += [
                "",
                f"With no traffic, CPU ms a second: one worker {values[0]:g}, two workers {values[1]:g}.",
            ]
    scaling = report.get("workers")
    if scaling:
        lines += [
            "",
            f"Workers (`--workers 2` against 1, front door on): req/s c32 x{scaling['rps_ratio']:.2f}, "
            f"CPU per request x{scaling['cpu_ratio']:.2f}. wrk (one thread) shares the 2 cores with the "
            "gateway, so this shows the cost per request of two processes more than the ceiling.",
        ]
    lines += [
        "",
        "gorgo+tracing is the same gateway with OpenTelemetry tracing on (every request sampled, a span "
        "per request exported over OTLP/HTTP to a local sink); the others run with tracing off, "
        "where the request path only tests that the tracer is None and imports nothing of OpenTelemetry.",
    ]
    front_door = report.get("front_door")
    if front_door and "added_p50_ms_c1" in front_door:
        lines += [
            "",
            "Front door (client key + shared rate limits, `gorgo+frontdoor` against `gorgo`), from the "
            f"table above (one run each, minutes apart): added p50 c1 {front_door['added_p50_ms_c1']:+.3f} ms, "
            f"CPU per request {front_door['added_cpu_us_per_request']:+.1f} µs, throughput c32 ratio "
            f"{front_door['rps_c32_ratio']:.3f}.",
        ]
    budget = (front_door or {}).get("budget")
    if budget:
        pairs = front_door["paired"]
        ours, twin = pairs["gorgo+frontdoor"], pairs["gorgo twin"]
        lines += [
            "",
            f"Issue 12's budget for the front door, judged on rounds taken in turns ({pairs['method']}). "
            "The twin runs the same code as the plain gateway: its column is this machine's noise.",
            "",
            "| figure (against the plain gateway) | front door: median (IQR) | budget | met | twin: median (IQR) |",
            "|---|---:|---:|---|---:|",
        ]
        for name, label, bound in (
            ("added_p50_ms_c1", "added p50 c1 (ms)", "≤ +0.05"),
            ("rps_c32_ratio", "throughput c32 ratio", "≥ 0.90"),
            ("rps_per_core_ratio", "req/s per core ratio", "≥ 0.90"),
            ("added_cpu_us_per_request", "added CPU per request (µs)", ""),
        ):
            met = "" if name not in budget else ("yes" if budget[name]["met"] else "**no**")

            def cell(figures: dict[str, Any], name: str = name) -> str:
                low, high = figures[f"{name}_iqr"]
                return f"{figures[name]:g} ({low:g} to {high:g})"

            lines.append(f"| {label} | {cell(ours)} | {bound} | {met} | {cell(twin)} |")
    elif (front_door or {}).get("paired"):
        lines += ["", f"Front door paired rounds failed: {front_door['paired'].get('error')}"]
    if report.get("tracing_off_hooks_ns") is not None:
        lines.append(
            f"Tracing off: the request path's tracing hooks cost {report['tracing_off_hooks_ns']:g} ns per "
            "request (timeit of the same statements; nothing of OpenTelemetry is imported). Tracing on: "
            f"{report['tracing_on_cpu_us']:g} µs of CPU per request for the span (started, answered, "
            "finished, batched for export; process time, in-process)."
        )
    swap = report.get("policy_swap_ms")
    if swap:
        lines.append(
            f"Policy swap, PUBLISH to the new version being served: {', '.join(f'{v:g}' for v in swap['samples'])} ms."
        )
    lines += [
        "",
        f"gorgo ran with {report['gorgo_setup']}; the request streams received {report['request_log_records']:,} records.",
        "The machine is shared: compare targets within one run, not across runs. Load average "
        f"(1/5/15 min) at the start {report['machine'].get('load_avg_1_5_15_at_start')}, at the end "
        f"{report['machine'].get('load_avg_1_5_15_at_end')}.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--algorithm", default="gorgo", help="policy algorithm of the gorgo targets (default gorgo)"
    )
    parser.add_argument("--c1-requests", type=int, default=3000, help="timed requests at concurrency 1")
    parser.add_argument("--c32-seconds", type=float, default=5.0, help="wrk duration at concurrency 32")
    parser.add_argument(
        "--stream-requests",
        type=int,
        default=800,
        help="streaming requests at concurrency 8 (and 1/8 of it at 1)",
    )
    parser.add_argument(
        "--pair-rounds",
        type=int,
        default=20,
        help="rounds of the front-door comparison (gorgo, its twin and gorgo+frontdoor taking turns; 0: skip)",
    )
    parser.add_argument(
        "--router-rounds",
        type=int,
        default=10,
        help="rounds of issue 25's comparison with the Rust router (taking turns; 0: skip)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        help="another checkout (with its .venv) whose gateway runs as `gorgo+frontdoor baseline`, e.g. main",
    )
    parser.add_argument("--pair-seconds", type=float, default=2.0, help="wrk duration per gateway per round")
    parser.add_argument(
        "--paced-rates",
        default="",
        help="comma-separated request rates: also compare --workers 2 with 1 at these paced loads "
        "(CPU per request, in turns; e.g. 2000,4000); empty: skip",
    )
    parser.add_argument("--paced-rounds", type=int, default=6, help="rounds per paced rate")
    parser.add_argument("--only", nargs="*", help="measure only these targets (direct always runs)")
    parser.add_argument("--skip-peers", action="store_true", help="direct and gorgo only")
    parser.add_argument("--with-httpx", action="store_true", help="also the bare proxy with httpx")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    parser.add_argument(
        "--shadow",
        metavar="ALGORITHM",
        help="measure only a shadow's cost (issue 23): gorgo, its twin and gorgo with this shadow "
        "policy take turns for --pair-rounds rounds; writes gateway_shadow_<live>_<shadow>.{json,md}",
    )
    parser.add_argument("--shadow-params", default="{}", help="the shadow policy's parameters (JSON)")
    args = parser.parse_args()
    exit_on_sigterm()  # a kill stops what this started
    sys.path.insert(0, str(ROOT))
    print("gateway overhead benchmark (bounded: about 20 s per target)", flush=True)
    load_at_start = os.getloadavg()
    outcome = run(args)
    if args.shadow:
        machine = _machine()
        machine["load_average"] = " / ".join(f"{value:.1f}" for value in os.getloadavg())
        shadow_report = {
            "generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": "python benchmarks/gateway_overhead.py " + " ".join(sys.argv[1:]),
            "machine": machine,
            "shadow_pairs": outcome["extras"]["shadow_pairs"],
            "request_log_records": outcome["request_log_records"],
        }
        args.out.mkdir(parents=True, exist_ok=True)
        name = f"gateway_shadow_{args.algorithm}_{args.shadow}"
        (args.out / f"{name}.json").write_text(json.dumps(shadow_report, indent=2) + "\n")
        if "error" in shadow_report["shadow_pairs"]:
            print(shadow_report["shadow_pairs"]["error"])
            return 1
        (args.out / f"{name}.md").write_text(_shadow_markdown(shadow_report))
        print(_shadow_markdown(shadow_report))
        return 0
    targets = outcome["results"]
    added = _added(targets)
    gorgo, front = targets.get("gorgo", {}), targets.get("gorgo+frontdoor", {})
    front_door: dict[str, Any] = {}
    if gorgo and front and "error" not in gorgo and "error" not in front:
        front_door = {
            "added_p50_ms_c1": round(front["p50_ms_c1"] - gorgo["p50_ms_c1"], 4),
            "added_cpu_us_per_request": round(front["cpu_us_per_request"] - gorgo["cpu_us_per_request"], 1),
            "rps_c32_ratio": round(front["rps_c32"] / gorgo["rps_c32"], 4),
        }
    pairs = outcome["extras"].get("front_door_pairs")
    if pairs and "error" not in pairs:
        # Issue 12's budget, judged on the rounds: +0.05 ms p50 and 10 % throughput at most.
        front_door["paired"] = pairs
        ours = pairs["gorgo+frontdoor"]
        front_door["budget"] = {
            "added_p50_ms_c1": {
                "value": ours["added_p50_ms_c1"],
                "max": 0.05,
                "met": ours["added_p50_ms_c1"] <= 0.05,
            },
            **{
                name: {"value": ours[name], "min": 0.90, "met": ours[name] >= 0.90}
                for name in ("rps_c32_ratio", "rps_per_core_ratio")
            },
        }
    elif pairs:
        front_door["paired"] = pairs
    two = targets.get("gorgo+frontdoor x2", {})
    workers: dict[str, Any] = {}
    if front and two and "error" not in front and "error" not in two:
        workers = {
            "rps_ratio": round(two["rps_c32"] / front["rps_c32"], 3),
            "cpu_ratio": round(two["cpu_us_per_request"] / front["cpu_us_per_request"], 3),
        }
    checks = _targets_vs_router(targets, added)
    report = {
        "generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            **_machine(),
            "load_avg_1_5_15_at_start": [round(v, 2) for v in load_at_start],
            "load_avg_1_5_15_at_end": [round(v, 2) for v in os.getloadavg()],
        },
        "method": {
            "c1": f"{args.c1_requests} sequential non-streaming chat completions on one keep-alive connection (after 200 warm-up)",
            "c32": f"{args.c32_seconds:g} s, 32 connections; CPU of the target's process group from /proc over that run",
            "stream": f"{args.stream_requests // 8} streaming chat completions from 1 client, then {args.stream_requests // 8 * 8} from 8 concurrent clients; TTFB = request sent -> first 'data:' byte",
        },
        "gorgo_setup": f"policy algorithm {args.algorithm}, {UPSTREAMS} nodes, request log on",
        "policy_swap_ms": outcome["extras"].get("policy_swap_ms"),
        "tracing_off_hooks_ns": round(_tracing_off_ns(), 1),
        "tracing_on_cpu_us": round(_tracing_on_cpu_us(), 1),
        "targets": targets,
        "added": added,
        "targets_vs_router": checks,
        "front_door": front_door,
        "workers": workers,
        "router_turns": outcome["extras"].get("router_turns"),
        "workers_paced": outcome["extras"].get("workers_paced"),
        "request_log_records": outcome["request_log_records"],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gateway_overhead.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "gateway_overhead.md").write_text(_markdown(report))
    print(_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
