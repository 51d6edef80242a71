"""The one stub vLLM node of the tests: vLLM's OpenAI API, ``/health`` and ``/metrics`` on
127.0.0.1:<free port>, with every answer steerable, and no engine behind it.

The emulated fleet (simulator/) is what end-to-end tests use; this stub lets a unit test control
exactly what a node answers (garbage metrics, a 503 health check, a slow region, a stream that
stops half-way). It runs in the test's own event loop (``await start()``, ``stub_nodes``) or, for
synchronous tests such as Django's, in a thread of its own (``start_in_thread``).

- OpenAI API (``/v1/chat/completions``, ``/v1/completions``): SSE chunks as in
  /work/shared/fixtures/vllm_chat_stream.txt, steered per request through an extra ``stub`` object
  in the body, which the gateway forwards unchanged:
  ``{"stub": {"chunks": 5, "chunk_delay_s": 0.05, "delay_s": 0, "status": 200, "eof_delay_s": 0}}``;
  ``first_event_delay_s``: a stream's head at once, its first event this much later (as vLLM's);
  ``head_with_first_event``: the head held back and sent in one write with the first event (as a
  busy vLLM API server sometimes does).
- ``api_status``: what every OpenAI API request gets when its ``stub`` names no status (a node
  whose engine died answers 500).
- ``/health``: ``health_status``, delayed by ``region_delays_ms[X-Gorgo-Region]`` (a far region).
- ``/metrics``: ``metrics`` (text, or a function returning it), vLLM's exposition format;
  ``metrics_byte_delay_s`` sends it a byte at a time (a node on a slow or lossy link).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

FIXTURES = Path(__file__).resolve().parent.parent / "telemetry" / "fixtures"
FIXTURE_METRICS = (FIXTURES / "vllm_metrics.txt").read_text()
THREAD_START_TIMEOUT_S = 10.0  # an upper bound for the stub's own start, never a measurement


@dataclass
class SeenRequest:
    path: str
    headers: CIMultiDict[str]
    body: dict[str, Any]


@dataclass
class StubNode:
    """A tiny vLLM look-alike; its attributes may be changed while it runs."""

    name: str = "stub"
    region_delays_ms: dict[str, float] = field(default_factory=dict)
    metrics: str | Callable[[], str] = FIXTURE_METRICS
    health_status: int = 200
    api_status: int = 200  # the OpenAI API's answer when the request's ``stub`` names none
    head_delay_s: float = 0.0  # every OpenAI API answer's head waits this long (a round trip away)
    metrics_byte_delay_s: float = 0.0  # /metrics body sent one byte at a time, this far apart (a slow link)
    seen: list[SeenRequest] = field(default_factory=list)  # OpenAI API requests, in order
    aborted: int = 0  # requests the client (the gateway) hung up on
    events_written: int = 0  # SSE content events written so far, over all streams
    streams_finished: int = 0
    health_requests: int = 0
    seen_regions: list[str] = field(default_factory=list)  # X-Gorgo-Region of each /health
    applied_delays_ms: list[float] = field(default_factory=list)  # the delay each /health waited
    runner: web.AppRunner | None = None
    port: int = 0
    _thread_loop: asyncio.AbstractEventLoop | None = field(default=None, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_post("/v1/completions", self._handle)
        app.router.add_post("/v1/embeddings", self._embeddings)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    # ---- for synchronous tests: the same server on an event loop in its own thread -----------

    def start_in_thread(self) -> StubNode:
        """Serve from a daemon thread's event loop until ``stop_thread()``; returns ``self``."""
        loop = asyncio.new_event_loop()
        self._thread_loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name=f"stub-{self.name}", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.start(), loop).result(THREAD_START_TIMEOUT_S)
        return self

    def stop_thread(self) -> None:
        loop, thread = self._thread_loop, self._thread
        if loop is None or thread is None:
            return
        asyncio.run_coroutine_threadsafe(self.stop(), loop).result(THREAD_START_TIMEOUT_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(THREAD_START_TIMEOUT_S)
        loop.close()
        self._thread_loop = self._thread = None

    # ---- handlers --------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        region = request.headers.get("X-Gorgo-Region", "")
        self.health_requests += 1
        self.seen_regions.append(region)
        delay_ms = self.region_delays_ms.get(region, 0.0)
        self.applied_delays_ms.append(delay_ms)
        if delay_ms:
            await asyncio.sleep(delay_ms / 1000.0)
        return web.Response(status=self.health_status, body=b"", content_type="text/plain")

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        text = self.metrics() if callable(self.metrics) else self.metrics
        headers = {"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
        if not self.metrics_byte_delay_s:
            return web.Response(body=text.encode(), headers=headers)
        response = web.StreamResponse(headers=headers)
        await response.prepare(request)
        for byte in text.encode():
            await response.write(bytes([byte]))
            await asyncio.sleep(self.metrics_byte_delay_s)
        await response.write_eof()
        return response

    async def _embeddings(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.seen.append(SeenRequest(request.path, CIMultiDict(request.headers), body))
        return web.json_response(
            {
                "object": "list",
                "data": [{"object": "embedding", "index": 0, "embedding": [0.25, -0.5]}],
                "model": body["model"],
                "usage": {"prompt_tokens": 3, "total_tokens": 3},
            },
            headers={"X-Stub-Node": self.name},
        )

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(SeenRequest(request.path, CIMultiDict(request.headers), body))
        stub = body.get("stub", {})
        if self.head_delay_s:
            await asyncio.sleep(self.head_delay_s)
        if stub.get("delay_s"):
            await asyncio.sleep(stub["delay_s"])
            if request.transport is None or request.transport.is_closing():
                self.aborted += 1  # the gateway hung up while we "generated"
                return web.Response(status=499)
        status = stub.get("status", self.api_status)
        if status != 200:
            error = {"message": "stub error", "type": "BadRequestError", "param": None, "code": status}
            return web.json_response({"error": error}, status=status)
        chat = request.path == "/v1/chat/completions"
        words = [f" w{i}" for i in range(stub.get("chunks", 3))]
        usage = {
            "prompt_tokens": 42,
            "total_tokens": 42 + len(words),
            "completion_tokens": len(words),
            "prompt_tokens_details": {"cached_tokens": 32},
        }
        if not body.get("stream"):
            text = "".join(words)
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                if chat
                else {"index": 0, "text": text, "finish_reason": "stop"}
            )
            return web.json_response(
                {
                    "id": "cmpl-stub",
                    "object": "chat.completion" if chat else "text_completion",
                    "created": 1767225600,
                    "model": body["model"],
                    "choices": [choice],
                    "usage": usage,
                    "served_by": self.name,
                },
                headers={"X-Stub-Node": self.name},
            )
        stream_class = _HeadWithFirstEvent if stub.get("head_with_first_event") else web.StreamResponse
        response = stream_class(headers={"Content-Type": "text/event-stream", "X-Stub-Node": self.name})
        await response.prepare(request)
        try:
            if stub.get("first_event_delay_s"):
                # vLLM sends a stream's head at once and its first event after queue and prefill.
                await asyncio.sleep(stub["first_event_delay_s"])
            for index, word in enumerate(words):
                delta = {"role": "assistant", "content": word} if index == 0 else {"content": word}
                choice = {"index": 0, "delta": delta} if chat else {"index": 0, "text": word}
                chunk = {"id": "cmpl-stub", "object": "chat.completion.chunk", "model": body["model"]}
                await response.write(
                    b"data: " + json.dumps({**chunk, "choices": [choice]}).encode() + b"\n\n"
                )
                self.events_written += 1
                if stub.get("chunk_delay_s"):
                    await asyncio.sleep(stub["chunk_delay_s"])
            if (body.get("stream_options") or {}).get("include_usage"):
                chunk = {"id": "cmpl-stub", "choices": [], "usage": usage}
                await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            if stub.get("eof_delay_s"):
                # The end of the body arrives after [DONE] (a slow last TCP segment).
                await asyncio.sleep(stub["eof_delay_s"])
            await response.write_eof()
            self.streams_finished += 1
        except (ConnectionResetError, asyncio.CancelledError):
            self.aborted += 1
            raise
        return response


class _HeadWithFirstEvent(web.StreamResponse):
    """A stream whose head aiohttp sends with its first body write, not at ``prepare`` (its
    ``web.Response`` does so; this is the same switch)."""

    _send_headers_immediately = False


@asynccontextmanager
async def stub_nodes(*names: str) -> AsyncIterator[list[StubNode]]:
    nodes = [StubNode(name) for name in names]
    for node in nodes:
        await node.start()
    try:
        yield nodes
    finally:
        for node in nodes:
            await node.stop()


def metrics_text(
    *,
    engines: dict[str, dict[str, float]],
    old_names: bool = False,
    ttft_buckets: dict[str, list[tuple[str, float]]] | None = None,
    queue_sum_count: dict[str, tuple[float, float]] | None = None,
    created: float = 1767225600.0,
) -> str:
    """A vLLM-format page with one series per engine.

    ``engines``: engine label -> {"running", "waiting", "kv", "queries", "hits", "prompt", "generation"}.
    ``ttft_buckets``: engine -> cumulative (le, count) pairs ending with "+Inf".
    ``queue_sum_count``: engine -> (sum seconds, count) of vllm:request_queue_time_seconds.
    """
    model = "meta-llama/Llama-3.1-8B-Instruct"
    kv_name = "vllm:gpu_cache_usage_perc" if old_names else "vllm:kv_cache_usage_perc"
    queries = "vllm:gpu_prefix_cache_queries" if old_names else "vllm:prefix_cache_queries"
    hits = "vllm:gpu_prefix_cache_hits" if old_names else "vllm:prefix_cache_hits"
    lines: list[str] = []

    def series(name: str, kind: str, key: str, total: bool = False) -> None:
        full = f"{name}_total" if total else name
        lines.append(f"# TYPE {full} {kind}")
        for engine, values in engines.items():
            if key in values:
                lines.append(f'{full}{{engine="{engine}",model_name="{model}"}} {values[key]}')
        if total:
            lines.append(f"# TYPE {name}_created gauge")
            for engine in engines:
                lines.append(f'{name}_created{{engine="{engine}",model_name="{model}"}} {created}')

    series("vllm:num_requests_running", "gauge", "running")
    series("vllm:num_requests_waiting", "gauge", "waiting")
    series(kv_name, "gauge", "kv")
    series(queries, "counter", "queries", total=True)
    series(hits, "counter", "hits", total=True)
    series("vllm:prompt_tokens", "counter", "prompt", total=True)
    series("vllm:generation_tokens", "counter", "generation", total=True)
    if ttft_buckets:
        lines.append("# TYPE vllm:time_to_first_token_seconds histogram")
        for engine, buckets in ttft_buckets.items():
            for le, count in buckets:
                lines.append(
                    f'vllm:time_to_first_token_seconds_bucket{{engine="{engine}",le="{le}",model_name="{model}"}} {count}'
                )
            total = buckets[-1][1]
            lines.append(
                f'vllm:time_to_first_token_seconds_count{{engine="{engine}",model_name="{model}"}} {total}'
            )
            lines.append(
                f'vllm:time_to_first_token_seconds_sum{{engine="{engine}",model_name="{model}"}} 0.0'
            )
    if queue_sum_count:
        for name in ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds"):
            lines.append(f"# TYPE {name} histogram")
            for engine, (sum_s, count) in queue_sum_count.items():
                labels = f'engine="{engine}",model_name="{model}"'
                lines.append(f'{name}_bucket{{{labels},le="1.0"}} {count}')
                lines.append(f'{name}_bucket{{{labels},le="+Inf"}} {count}')
                lines.append(f"{name}_count{{{labels}}} {count}")
                lines.append(f"{name}_sum{{{labels}}} {sum_s}")
    return "\n".join(lines) + "\n"
