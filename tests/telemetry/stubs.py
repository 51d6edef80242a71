"""A small threaded HTTP stand-in for a vLLM node: /health (with per-region delay) and /metrics.

The emulated fleet (simulator/) is what the end-to-end test uses; these stubs let the unit tests
control exactly what a node answers (garbage, 503, a slow region) without an engine behind it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures"
FIXTURE_METRICS = (FIXTURES / "vllm_metrics.txt").read_text()


class StubNode:
    """Serves on 127.0.0.1:<free port> until ``stop()``; attributes may be changed while running."""

    def __init__(
        self,
        *,
        region_delays_ms: dict[str, float] | None = None,
        metrics: str | Callable[[], str] = FIXTURE_METRICS,
    ) -> None:
        self.region_delays_ms = dict(region_delays_ms or {})
        self.metrics = metrics
        self.health_status = 200
        self.health_requests = 0
        self.seen_regions: list[str] = []
        self.applied_delays_ms: list[float] = []  # the delay each /health answer waited, in order
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, like vLLM's uvicorn

            def do_GET(self) -> None:
                if self.path == "/health":
                    region = self.headers.get("X-Gorgo-Region", "")
                    stub.health_requests += 1
                    stub.seen_regions.append(region)
                    delay_ms = stub.region_delays_ms.get(region, 0.0)
                    stub.applied_delays_ms.append(delay_ms)
                    if delay_ms:
                        time.sleep(delay_ms / 1000.0)
                    self._reply(stub.health_status, b"")
                elif self.path == "/metrics":
                    text = stub.metrics() if callable(stub.metrics) else stub.metrics
                    self._reply(200, text.encode(), "text/plain; version=0.0.4; charset=utf-8")
                else:
                    self._reply(404, b"")

            def _reply(self, status: int, body: bytes, content_type: str = "text/plain") -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self.thread.start()

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


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
