"""HTTP to the nodes: RTT probes (GET /health) and metrics fetches (GET /metrics).

One ``httpx.Client`` per worker process, kept alive between rounds, so a probe normally measures
one application-level round trip on an open connection. When it had to open a new connection
(first probe, or the server closed an idle one: vLLM's uvicorn keeps idle connections only 5 s
by default) the TCP/TLS setup is timed separately (``connect_ms``) from httpx's trace extension
and left out of ``rtt_ms``, which is "request headers sent -> response headers received".

Nodes are contacted concurrently from a small thread pool (httpx's client is thread-safe), so a
round takes about as long as the slowest node, not the sum.
"""

from __future__ import annotations

import functools
import os
import ssl
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
from django.conf import settings

from telemetry.vllm_metrics import MAX_METRICS_BYTES

REGION_HEADER = "X-Gorgo-Region"
MAX_PARALLEL = 32


@dataclass(frozen=True, slots=True)
class Target:
    """A node to contact."""

    node_id: int
    base_url: str


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """One GET /health from a region to a node."""

    node_id: int
    ok: bool
    started_at: float  # unix seconds
    rtt_ms: float | None = None
    connect_ms: float | None = None  # only when a new connection was opened
    status_code: int | None = None
    error: str = ""


@dataclass(frozen=True, slots=True)
class FetchResult:
    """One GET /metrics."""

    node_id: int
    fetched_at: float
    text: str | None = None
    status_code: int | None = None
    error: str = ""


class NodeHTTP:
    """The worker process's HTTP client and thread pool for talking to nodes."""

    def __init__(self, *, keepalive_s: float = 120.0, max_parallel: int = MAX_PARALLEL) -> None:
        self.client = httpx.Client(
            # Idle connections must outlive the probe interval, or every probe reconnects.
            limits=httpx.Limits(
                max_connections=256, max_keepalive_connections=256, keepalive_expiry=keepalive_s
            ),
            timeout=httpx.Timeout(5.0),
            follow_redirects=False,
            headers={"User-Agent": "gorgo-telemetry"},
            # Reach the nodes as the gateways do: directly (a worker's HTTP_PROXY would put the
            # proxy's round trip in every RTT) and trusting the system's CAs, as the gateway's
            # ssl.create_default_context() does (SSL_CERT_FILE/SSL_CERT_DIR still apply, via OpenSSL).
            trust_env=False,
            verify=ssl.create_default_context(),
        )
        self.executor = ThreadPoolExecutor(max_workers=max_parallel, thread_name_prefix="gorgo-node-http")

    def map(self, func: Callable[[Target], Any], targets: Iterable[Target]) -> list[Any]:
        return list(self.executor.map(func, targets))

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.client.close()

    # -- probes --------------------------------------------------------------------------------

    def probe_all(self, region: str, targets: Iterable[Target], timeout_s: float) -> list[ProbeResult]:
        return self.map(lambda target: self.probe(region, target, timeout_s), targets)

    def probe(self, region: str, target: Target, timeout_s: float) -> ProbeResult:
        """GET /health with the probing region's header; retried once if a kept-alive connection died."""
        result, reused_connection_failed = self._probe_once(region, target, timeout_s)
        if reused_connection_failed:
            result, _ = self._probe_once(region, target, timeout_s)
        return result

    def _probe_once(self, region: str, target: Target, timeout_s: float) -> tuple[ProbeResult, bool]:
        marks: dict[str, float] = {}

        def trace(event: str, info: dict) -> None:
            marks.setdefault(_TRACE_ALIASES.get(event, event), time.perf_counter())

        started_at = time.time()
        start = time.perf_counter()
        try:
            response = self.client.get(
                f"{target.base_url}/health",
                headers={REGION_HEADER: region},
                timeout=timeout_s,
                extensions={"trace": trace},
            )
        except httpx.HTTPError as exc:
            # A server may close an idle keep-alive connection just as we reuse it: that is not
            # the node failing, so the caller retries once on a fresh connection.
            reused = "connect_tcp.started" not in marks and isinstance(
                exc, httpx.RemoteProtocolError | httpx.ReadError | httpx.WriteError
            )
            return ProbeResult(target.node_id, ok=False, started_at=started_at, error=_describe(exc)), reused
        elapsed_ms = (time.perf_counter() - start) * 1000.0
        connect_ms = None
        if "connect_tcp.started" in marks:
            connect_end = marks.get("start_tls.complete", marks.get("connect_tcp.complete", start))
            connect_ms = round((connect_end - marks["connect_tcp.started"]) * 1000.0, 3)
        if "send_request_headers.started" in marks and "receive_response_headers.complete" in marks:
            rtt_ms = (
                marks["receive_response_headers.complete"] - marks["send_request_headers.started"]
            ) * 1000.0
        else:
            rtt_ms = elapsed_ms - (connect_ms or 0.0)
        ok = response.status_code == 200
        return (
            ProbeResult(
                target.node_id,
                ok=ok,
                started_at=started_at,
                rtt_ms=round(rtt_ms, 3),
                connect_ms=connect_ms,
                status_code=response.status_code,
                error="" if ok else f"GET /health answered {response.status_code}",
            ),
            False,
        )

    # -- metrics -------------------------------------------------------------------------------

    def fetch_all(self, targets: Iterable[Target], timeout_s: float) -> list[FetchResult]:
        return self.map(lambda target: self.fetch_metrics(target, timeout_s), targets)

    def fetch_metrics(self, target: Target, timeout_s: float) -> FetchResult:
        """GET /metrics, refusing bodies over ``MAX_METRICS_BYTES`` instead of buffering them.

        ``timeout_s`` bounds the whole body too, not only each read: httpx's timeouts apply per
        network operation, so a page arriving a few bytes at a time (a slow or lossy link) would
        otherwise keep the round, and every other node's scrape in it, waiting without end.
        """
        fetched_at = time.time()
        deadline = time.monotonic() + timeout_s
        try:
            with self.client.stream("GET", f"{target.base_url}/metrics", timeout=timeout_s) as response:
                if response.status_code != 200:
                    return FetchResult(
                        target.node_id,
                        fetched_at,
                        status_code=response.status_code,
                        error=f"GET /metrics answered {response.status_code}",
                    )
                chunks, size = [], 0
                for chunk in response.iter_bytes():
                    size += len(chunk)
                    if size > MAX_METRICS_BYTES:
                        return FetchResult(
                            target.node_id,
                            fetched_at,
                            status_code=200,
                            error=f"GET /metrics body larger than {MAX_METRICS_BYTES} bytes",
                        )
                    chunks.append(chunk)
                    if time.monotonic() > deadline:
                        return FetchResult(
                            target.node_id,
                            fetched_at,
                            status_code=200,
                            error=f"GET /metrics took longer than {timeout_s:g} s",
                        )
                text = b"".join(chunks).decode(response.encoding or "utf-8", errors="replace")
                return FetchResult(target.node_id, fetched_at, text=text, status_code=200)
        except httpx.HTTPError as exc:
            return FetchResult(target.node_id, fetched_at, error=_describe(exc))


# httpcore names events "<protocol>.<step>" (http11.*, http2.*) and "connection.<step>".
_TRACE_ALIASES = {
    f"{protocol}.{step}": step
    for protocol in ("http11", "http2")
    for step in ("send_request_headers.started", "receive_response_headers.complete")
} | {
    "connection.connect_tcp.started": "connect_tcp.started",
    "connection.connect_tcp.complete": "connect_tcp.complete",
    "connection.start_tls.complete": "start_tls.complete",
}


def _describe(exc: httpx.HTTPError) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:300]


@functools.cache
def node_http() -> NodeHTTP:
    """The process's client: created on first use, so each forked worker child makes its own."""
    keepalive_s = max(120.0, 4 * max(settings.GORGO_PROBE_INTERVAL_S, settings.GORGO_SCRAPE_INTERVAL_S))
    return NodeHTTP(keepalive_s=keepalive_s)


# A client inherited through fork would share sockets with the parent: start afresh in the child.
os.register_at_fork(after_in_child=node_http.cache_clear)
