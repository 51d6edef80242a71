"""GET /v1/models, /healthz and /metrics."""

from __future__ import annotations

from tests.routing.support import MODEL, gateway_config, make_node, make_snapshot, publish, running_gateway

OTHER = "Qwen/Qwen2.5-7B-Instruct"


class TestEndpoints:
    async def test_it_lists_the_models_the_policy_serves(self, aredis, redis_keys, redis_url, stubs):
        nodes = (make_node(1, stubs[0].url, models=(MODEL, OTHER)),)
        await publish(aredis, redis_keys, make_snapshot(nodes, model_scope=(MODEL,)))
        async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
            client = gateway.http
            listing = (await client.get(f"{gateway.url}/v1/models")).json()
            other = await client.post(
                f"{gateway.url}/v1/chat/completions",
                json={"model": OTHER, "messages": [{"role": "user", "content": "x"}]},
            )
        assert listing["object"] == "list"
        assert [model["id"] for model in listing["data"]] == [MODEL]
        assert other.status_code == 404  # outside the policy scope

    async def test_it_is_healthy_once_a_policy_is_loaded(self, aredis, redis_keys, redis_url, stubs):
        await publish(aredis, redis_keys, make_snapshot((make_node(1, stubs[0].url),), version=12))
        async with running_gateway(gateway_config(redis_keys, redis_url, region="ap-south")) as gateway:
            client = gateway.http
            health = await client.get(f"{gateway.url}/healthz")
        assert health.status_code == 200
        assert health.json() == {
            "status": "ok",
            "region": "ap-south",
            "gateway_id": "test-gw-ap-south",
            "policy_version": 12,
            "redis_connected": True,
        }

    async def test_it_exposes_prometheus_metrics(self, aredis, redis_keys, redis_url, stubs):
        await publish(
            aredis, redis_keys, make_snapshot((make_node(1, stubs[0].url, name="gpu-a"),), version=4)
        )
        async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
            client = gateway.http
            body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
            await client.post(f"{gateway.url}/v1/chat/completions", json=body)
            await client.post(f"{gateway.url}/v1/chat/completions", json={**body, "stream": True})
            await client.post(f"{gateway.url}/v1/chat/completions", json={**body, "model": "nope"})
            response = await client.get(f"{gateway.url}/metrics")
        text = response.text
        assert response.headers["content-type"].startswith("text/plain")
        assert 'gorgo_gateway_requests_total{node="gpu-a",status="200"} 2.0' in text
        assert 'gorgo_gateway_requests_total{node="none",status="404"} 1.0' in text
        assert 'gorgo_gateway_ttft_seconds_count{node="gpu-a"} 2.0' in text
        assert 'gorgo_gateway_request_duration_seconds_count{node="gpu-a"} 2.0' in text
        assert "gorgo_gateway_routing_decision_seconds_count 2.0" in text
        assert 'gorgo_gateway_inflight_requests{node="gpu-a"} 0.0' in text
        assert "gorgo_gateway_policy_version 4.0" in text
        assert "gorgo_gateway_redis_connected 1.0" in text
        assert "gorgo_gateway_request_log_dropped_total 0.0" in text
