"""Headers: what the node receives, and what the client gets back."""

from __future__ import annotations

import re

from tests.routing.support import MODEL, gateway_config, make_node, make_snapshot, publish, running_gateway

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


async def gateway_for(aredis, redis_keys, redis_url, stub):
    await publish(aredis, redis_keys, make_snapshot((make_node(1, stub.url, name="gpu-a"),), version=7))
    return running_gateway(gateway_config(redis_keys, redis_url, region="eu-central"))


class TestHeaders:
    async def test_it_adds_request_id_and_region_upstream(self, aredis, redis_keys, redis_url, stubs):
        async with await gateway_for(aredis, redis_keys, redis_url, stubs[0]) as gateway:
            client = gateway.http
            response = await client.post(f"{gateway.url}/v1/chat/completions", json=BODY)
        seen = stubs[0].seen[0].headers
        assert seen["X-Gorgo-Region"] == "eu-central"
        assert seen["X-Request-Id"] == response.headers["x-request-id"]
        assert len(seen["X-Request-Id"]) >= 8

    async def test_it_keeps_the_clients_request_id(self, aredis, redis_keys, redis_url, stubs):
        async with await gateway_for(aredis, redis_keys, redis_url, stubs[0]) as gateway:
            client = gateway.http
            response = await client.post(
                f"{gateway.url}/v1/chat/completions", json=BODY, headers={"X-Request-Id": "client-id-42"}
            )
        assert response.headers["x-request-id"] == "client-id-42"
        assert stubs[0].seen[0].headers.getall("X-Request-Id") == ["client-id-42"]

    async def test_it_forwards_end_to_end_headers_and_drops_hop_by_hop_ones(
        self, aredis, redis_keys, redis_url, stubs
    ):
        headers = {
            "Authorization": "Bearer sk-test",
            "X-Custom": "kept",
            "Connection": "keep-alive, X-Drop-Me",
            "X-Drop-Me": "listed in Connection",
            "Keep-Alive": "timeout=5",
            "Proxy-Authorization": "Basic secret",
            "TE": "trailers",
            "X-Gorgo-Region": "spoofed",
        }
        async with await gateway_for(aredis, redis_keys, redis_url, stubs[0]) as gateway:
            client = gateway.http
            await client.post(f"{gateway.url}/v1/chat/completions", json=BODY, headers=headers)
        seen = stubs[0].seen[0].headers
        assert seen["Authorization"] == "Bearer sk-test"
        assert seen["X-Custom"] == "kept"
        for dropped in ("X-Drop-Me", "Keep-Alive", "Proxy-Authorization", "TE"):
            assert dropped not in seen
        assert seen.getall("X-Gorgo-Region") == ["eu-central"]
        assert seen["Host"] == stubs[0].url.removeprefix("http://")
        assert seen["Content-Type"] == "application/json"

    async def test_it_names_node_policy_and_timing_in_the_response(
        self, aredis, redis_keys, redis_url, stubs
    ):
        async with await gateway_for(aredis, redis_keys, redis_url, stubs[0]) as gateway:
            client = gateway.http
            response = await client.post(f"{gateway.url}/v1/chat/completions", json=BODY)
            stream = await client.post(f"{gateway.url}/v1/chat/completions", json={**BODY, "stream": True})
        for answer in (response, stream):
            assert answer.status_code == 200
            assert answer.headers["x-gorgo-node"] == "gpu-a"
            assert answer.headers["x-gorgo-policy-version"] == "7"
            assert re.fullmatch(
                r"route;dur=\d+\.\d{3}, upstream;dur=\d+\.\d{3}", answer.headers["server-timing"]
            )
            assert answer.headers["x-stub-node"] == "a"  # the node's own headers pass through
        assert stream.headers["content-type"] == "text/event-stream"
        assert "transfer-encoding" not in response.headers  # the node's content-length is kept
        assert int(response.headers["content-length"]) == len(response.content)
