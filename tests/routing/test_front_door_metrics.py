"""The front door's Prometheus metrics carry exactly the names the dashboards and alerts use."""

from __future__ import annotations

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

NAMES = [
    ("gorgo_gateway_auth_failures_total", "counter"),
    ("gorgo_gateway_rate_limited_total", "counter"),
    ("gorgo_gateway_key_requests_total", "counter"),
    ("gorgo_gateway_queue_length", "gauge"),
    ("gorgo_gateway_queue_wait_seconds", "histogram"),
    ("gorgo_gateway_queue_rejected_total", "counter"),
    ("gorgo_gateway_breaker_state", "gauge"),
    ("gorgo_gateway_timeouts_total", "counter"),
    ("gorgo_gateway_retries_total", "counter"),
    ("gorgo_gateway_connections_open", "gauge"),
    ("gorgo_gateway_connections_rejected_total", "counter"),
    ("gorgo_gateway_keyset_version", "gauge"),
]


async def test_every_front_door_metric_is_exposed(aredis, redis_keys, redis_url, stubs):
    await publish(aredis, redis_keys, make_snapshot((make_node(1, stubs[0].url, name="gpu-a"),)))
    await publish_keys(aredis, redis_keys, make_key("gorgo-sk-k1-x", requests_per_min=1))
    async with running_gateway(gateway_config(redis_keys, redis_url, auth="on")) as gateway:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
        for _ in range(2):
            await gateway.http.post("/v1/chat/completions", json=body, headers={"api-key": "gorgo-sk-k1-x"})
        text = (await gateway.http.get("/metrics")).text
        version = gateway.app.runtime.front_door.store.version
    exposed = {line.split()[2]: line.split()[3] for line in text.splitlines() if line.startswith("# TYPE ")}
    for name, kind in NAMES:
        assert exposed.get(name) == kind, (name, exposed.get(name))
    assert 'gorgo_gateway_rate_limited_total{key_id="k1",reason="requests"} 1.0' in text
    assert 'gorgo_gateway_breaker_state{node="gpu-a"} 0.0' in text
    (line,) = [line for line in text.splitlines() if line.startswith("gorgo_gateway_keyset_version ")]
    assert float(line.split()[1]) == version
