"""The gateway's lock-free metrics write what prometheus_client's own objects would, and a scrape
sees every request finished before it (nothing is left pending)."""

from __future__ import annotations

import math
import re

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from routing.observability.exporter import (
    _DECISION_BUCKETS_S,
    _LATENCY_BUCKETS_S,
    _QUEUE_WAIT_BUCKETS_S,
    GatewayMetrics,
)
from tests.routing.support import (
    MODEL,
    gateway_config,
    make_key,
    make_node,
    make_snapshot,
    publish,
    publish_keys,
    running_gateway,
)


def _reference() -> tuple[CollectorRegistry, dict[str, Counter | Histogram]]:
    """The families as prometheus_client objects, declared in the gateway's order."""
    registry = CollectorRegistry(auto_describe=True)
    families: dict[str, Counter | Histogram] = {
        "requests": Counter(
            "gorgo_gateway_requests",
            "Finished requests by node and HTTP status.",
            ("node", "status"),
            registry=registry,
        ),
        "ttft": Histogram(
            "gorgo_gateway_ttft_seconds",
            "Gateway arrival to first byte sent to the client.",
            ("node",),
            buckets=_LATENCY_BUCKETS_S,
            registry=registry,
        ),
        "duration": Histogram(
            "gorgo_gateway_request_duration_seconds",
            "Gateway arrival to last byte sent to the client (end to end).",
            ("node",),
            buckets=_LATENCY_BUCKETS_S,
            registry=registry,
        ),
        "decision": Histogram(
            "gorgo_gateway_routing_decision_seconds",
            "Time to choose a node (view building, prefix match and algorithm).",
            buckets=_DECISION_BUCKETS_S,
            registry=registry,
        ),
        "upstream_errors": Counter(
            "gorgo_gateway_upstream_errors",
            "Failures talking to a node, by kind (connect, timeout, disconnect).",
            ("node", "kind"),
            registry=registry,
        ),
        "auth_failures": Counter(
            "gorgo_gateway_auth_failures",
            "Requests refused for their client key, by reason.",
            ("reason",),
            registry=registry,
        ),
        "rate_limited": Counter(
            "gorgo_gateway_rate_limited",
            "Requests refused by a client key's limits (429), by key and reason.",
            ("key_id", "reason"),
            registry=registry,
        ),
        "key_requests": Counter(
            "gorgo_gateway_key_requests",
            "Finished requests per client key, priority class and status class.",
            ("key_id", "priority", "status_class"),
            registry=registry,
        ),
        "retries": Counter(
            "gorgo_gateway_retries",
            "Requests sent again to a node before any byte reached the client, by the first failure.",
            ("reason",),
            registry=registry,
        ),
        "queue_wait": Histogram(
            "gorgo_gateway_queue_wait_seconds",
            "Time requests waited for a node with room, by priority class.",
            ("priority",),
            buckets=_QUEUE_WAIT_BUCKETS_S,
            registry=registry,
        ),
        "queue_rejected": Counter(
            "gorgo_gateway_queue_rejected",
            "Requests refused (503) by the admission queue, by priority and reason (full, timeout).",
            ("priority", "reason"),
            registry=registry,
        ),
        "prefix_rent": Counter(
            "gorgo_gateway_prefix_rent_seconds",
            "Estimated TTFT that requests sent abroad for a prefix their region does not hold paid "
            "for it (gorgo's homing rent).",
            registry=registry,
        ),
        "prefixes_homed": Counter(
            "gorgo_gateway_prefixes_homed",
            "Prompt prefixes held only abroad that a request stayed home to cache (gorgo's homing).",
            registry=registry,
        ),
    }
    return registry, families


def _without_created_values(text: str) -> str:
    # Creation times differ by the microseconds between the two objects' first updates.
    return re.sub(r"^(\w+_created(\{[^}]*\})?) \S+$", r"\1 T", text, flags=re.MULTILINE)


def test_it_writes_what_prometheus_clients_objects_would() -> None:
    metrics = GatewayMetrics()
    registry, ref = _reference()
    # Values on bucket bounds, between them, past the last, zero; labels in a changing order.
    latencies_s = [0.0, 0.005, 0.0051, 0.1, 0.7, 2.5, 119.0, 120.0, 500.0, 1e-9]
    for i, latency_s in enumerate(latencies_s * 3):
        node = ("gpu-a", "gpu-b", "none")[i % 3]
        status = (200, 503, 404, 200)[i % 4]
        ttft_s = None if i % 4 == 0 else latency_s / 2
        metrics.observe_request(node, status, ttft_s, latency_s)
        ref["requests"].labels(node, str(status)).inc()
        ref["duration"].labels(node).observe(latency_s)
        if ttft_s is not None:
            ref["ttft"].labels(node).observe(ttft_s)
        metrics.observe_decision(latency_s / 1e4)
        ref["decision"].observe(latency_s / 1e4)
        metrics.key_request(f"k{i % 2}", "interactive", status)
        ref["key_requests"].labels(f"k{i % 2}", "interactive", f"{status // 100}xx").inc()
    metrics.queue_wait("batch", 0.3)
    ref["queue_wait"].labels("batch").observe(0.3)
    metrics.queue_rejected("batch", "full")
    ref["queue_rejected"].labels("batch", "full").inc()
    metrics.retry("connect")
    ref["retries"].labels("connect").inc()
    metrics.auth_failure("unknown")
    ref["auth_failures"].labels("unknown").inc()
    metrics.rate_limited("k1", "requests")
    ref["rate_limited"].labels("k1", "requests").inc()
    metrics.upstream_error("gpu-a", "timeout")
    ref["upstream_errors"].labels("gpu-a", "timeout").inc()
    metrics.prefix_rent(125.0)
    metrics.prefix_rent(0.5)
    ref["prefix_rent"].inc(0.1255)
    metrics.prefix_homed()
    ref["prefixes_homed"].inc()

    ours = _without_created_values(metrics.render().decode())
    theirs = _without_created_values(generate_latest(registry).decode())
    assert ours == theirs
    assert "gorgo_gateway_requests_created{" in ours  # the creation series are there, as theirs


def test_an_unused_gateway_writes_the_same_empty_families() -> None:
    registry, _ = _reference()
    ours = _without_created_values(GatewayMetrics().render().decode())
    assert ours == _without_created_values(generate_latest(registry).decode())


def test_creation_times_are_first_use_times() -> None:
    metrics = GatewayMetrics()
    metrics.observe_request("gpu-a", 200, 0.1, 0.2)
    text = metrics.render().decode()
    (line,) = [line for line in text.splitlines() if line.startswith("gorgo_gateway_requests_created{")]
    assert math.isfinite(float(line.split()[1])) and float(line.split()[1]) > 1.7e9


async def test_a_scrape_right_after_n_requests_counts_all_n(aredis, redis_keys, redis_url, stubs):
    await publish(aredis, redis_keys, make_snapshot((make_node(1, stubs[0].url, name="gpu-a"),)))
    await publish_keys(aredis, redis_keys, make_key("gorgo-sk-k1-x", requests_per_min=1000))
    n = 12
    async with running_gateway(gateway_config(redis_keys, redis_url, auth="on")) as gateway:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
        for i in range(n):
            await gateway.http.post(
                "/v1/chat/completions",
                json={**body, "stream": i % 2 == 0},
                headers={"api-key": "gorgo-sk-k1-x"},
            )
        text = (await gateway.http.get("/metrics")).text
    assert f'gorgo_gateway_requests_total{{node="gpu-a",status="200"}} {n}.0' in text
    assert f'gorgo_gateway_request_duration_seconds_count{{node="gpu-a"}} {n}.0' in text
    assert f'gorgo_gateway_ttft_seconds_bucket{{le="+Inf",node="gpu-a"}} {n}.0' in text
    assert f"gorgo_gateway_routing_decision_seconds_count {n}.0" in text
    assert (
        f'gorgo_gateway_key_requests_total{{key_id="k1",priority="interactive",status_class="2xx"}} {n}.0'
        in text
    )
