"""GET /v1/models, /healthz and /metrics."""

from __future__ import annotations

from routing.contract import PrefixAffinityParams
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

OTHER = "Qwen/Qwen2.5-7B-Instruct"
SECRET = "gorgo-sk-k1-models-listing-secret"
AUTH = {"Authorization": f"Bearer {SECRET}"}


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


class TestOtherEndpoints:
    """Issue 22, item 14: /v1/models answered without a key, and vLLM's other endpoints got a bare
    404 "No route"."""

    async def test_models_need_a_key_when_auth_is_on(self, aredis, redis_keys, redis_url, stubs):
        await publish(aredis, redis_keys, make_snapshot((make_node(1, stubs[0].url),)))
        await publish_keys(aredis, redis_keys, make_key(SECRET))
        config = gateway_config(redis_keys, redis_url, auth="on")
        async with running_gateway(config) as gateway:
            anonymous = await gateway.http.get("/v1/models")
            one = await gateway.http.get(f"/v1/models/{MODEL}")
            wrong = await gateway.http.get("/v1/models", headers={"Authorization": "Bearer nope"})
            keyed = await gateway.http.get("/v1/models", headers=AUTH)
        assert anonymous.status_code == 401 and one.status_code == 401 and wrong.status_code == 401
        assert anonymous.json()["error"]["code"] == "invalid_api_key"
        assert keyed.status_code == 200
        assert [model["id"] for model in keyed.json()["data"]] == [MODEL]

    async def test_embeddings_are_routed_by_load_without_prefix_credit(
        self, aredis, redis_keys, redis_url, stubs
    ):
        nodes = (make_node(1, stubs[0].url, name="a"), make_node(2, stubs[1].url, name="b"))
        # A cache-aware policy would send the same prompt to the same node every time.
        await publish(aredis, redis_keys, make_snapshot(nodes, params=PrefixAffinityParams()))
        body = {"model": MODEL, "input": "the same text, again and again " * 20}
        async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
            answers = [await gateway.http.post("/v1/embeddings", json=body) for _ in range(6)]
            chats = [
                await gateway.http.post(
                    "/v1/chat/completions",
                    json={"model": MODEL, "messages": [{"role": "user", "content": body["input"]}]},
                )
                for _ in range(4)
            ]
            bad = await gateway.http.post("/v1/embeddings", json={"model": MODEL})
        assert [answer.status_code for answer in answers] == [200] * 6
        assert answers[0].json()["data"][0]["embedding"] == [0.25, -0.5]
        # Idle nodes take turns (least load), where the prefix policy keeps the chats on one node.
        assert {answer.headers["x-gorgo-node"] for answer in answers} == {"a", "b"}
        assert len({chat.headers["x-gorgo-node"] for chat in chats}) == 1
        assert {seen.path for stub in stubs for seen in stub.seen} >= {"/v1/embeddings"}
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"

    async def test_vllm_endpoints_it_does_not_route_say_why(self, aredis, redis_keys, redis_url, stubs):
        await publish(aredis, redis_keys, make_snapshot((make_node(1, stubs[0].url),)))
        async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
            answers = {
                path: await gateway.http.post(path, json={"model": MODEL, "input": "x"})
                for path in ("/v1/responses", "/tokenize", "/detokenize", "/v1/audio/transcriptions")
            }
            unknown = await gateway.http.post("/v1/nothing", json={})
        for path, answer in answers.items():
            assert answer.status_code == 501, path
            error = answer.json()["error"]
            assert error["type"] == "NotImplementedError" and error["code"] == "unsupported_endpoint"
            assert path in error["message"] and "/v1/embeddings" in error["message"]
        assert unknown.status_code == 404
        assert "/v1/chat/completions" in unknown.json()["error"]["message"]
