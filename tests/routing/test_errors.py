"""Errors in OpenAI's shape with the right status, and never a stack trace."""

from __future__ import annotations

from dataclasses import replace

import httpx
import pytest

from routing.algorithms import REGISTRY
from simulator.harness import free_port
from tests.routing.support import MODEL, gateway_config, make_node, make_snapshot, publish, running_gateway

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def closed_port_url() -> str:
    """A URL nothing listens on (connections are refused)."""
    return f"http://127.0.0.1:{free_port()}"


def assert_openai_error(response: httpx.Response, status: int, error_type: str) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == error_type and error["code"] == status
    assert "Traceback" not in response.text and 'File "' not in response.text
    return error


@pytest.fixture
async def gateway(aredis, redis_keys, redis_url, stubs):
    nodes = (make_node(1, stubs[0].url, name="gpu-a"), make_node(2, stubs[1].url, name="gpu-b"))
    await publish(aredis, redis_keys, make_snapshot(nodes))
    async with running_gateway(gateway_config(redis_keys, redis_url, max_body_bytes=2048)) as running:
        yield running


class TestRequestErrors:
    async def test_it_rejects_malformed_json_with_400(self, gateway):
        async with httpx.AsyncClient() as client:
            response = await client.post(f"{gateway.url}/v1/chat/completions", content=b'{"model": ')
        assert_openai_error(response, 400, "BadRequestError")

    async def test_it_names_a_missing_field(self, gateway):
        async with httpx.AsyncClient() as client:
            response = await client.post(f"{gateway.url}/v1/completions", json={"model": MODEL})
        assert assert_openai_error(response, 400, "BadRequestError")["param"] == "prompt"

    async def test_it_answers_404_for_an_unknown_model(self, gateway):
        async with httpx.AsyncClient() as client:
            response = await client.post(
                f"{gateway.url}/v1/chat/completions", json={**BODY, "model": "gpt-9"}
            )
        error = assert_openai_error(response, 404, "NotFoundError")
        assert "gpt-9" in error["message"] and error["param"] == "model"

    async def test_it_answers_413_for_a_body_over_the_limit(self, gateway):
        big = {**BODY, "messages": [{"role": "user", "content": "x" * 4096}]}
        async with httpx.AsyncClient() as client:
            response = await client.post(f"{gateway.url}/v1/chat/completions", json=big)
            assert_openai_error(response, 413, "RequestEntityTooLargeError")

            async def chunked():  # no Content-Length: the limit holds while reading
                for _ in range(8):
                    yield b"x" * 512

            response = await client.post(f"{gateway.url}/v1/chat/completions", content=chunked())
            assert_openai_error(response, 413, "RequestEntityTooLargeError")

    async def test_it_answers_404_and_405_for_other_routes(self, gateway):
        async with httpx.AsyncClient() as client:
            assert_openai_error(await client.get(f"{gateway.url}/v1/no-such-thing"), 404, "NotFoundError")
            # /v1/embeddings is routed since issue 22: POST only, like the other inference paths.
            assert_openai_error(
                await client.get(f"{gateway.url}/v1/embeddings"), 405, "MethodNotAllowedError"
            )
            wrong_method = await client.get(f"{gateway.url}/v1/chat/completions")
            assert_openai_error(wrong_method, 405, "MethodNotAllowedError")
            # RFC 9110 15.5.6: a 405 names the methods the resource takes (before: no Allow field).
            assert wrong_method.headers["allow"] == "POST"
            wrong_method = await client.post(f"{gateway.url}/v1/models")
            assert_openai_error(wrong_method, 405, "MethodNotAllowedError")
            assert wrong_method.headers["allow"] == "GET, HEAD"

    async def test_it_passes_a_nodes_own_error_through(self, gateway, stubs):
        async with httpx.AsyncClient() as client:
            response = await client.post(
                f"{gateway.url}/v1/chat/completions", json={**BODY, "stub": {"status": 400}}
            )
        assert response.status_code == 400
        assert response.json()["error"]["message"] == "stub error"
        assert response.headers["x-gorgo-node"] in ("gpu-a", "gpu-b")


class TestNodeErrors:
    async def test_it_answers_503_with_retry_after_when_no_node_is_eligible(
        self, aredis, redis_keys, redis_url, stubs
    ):
        nodes = (make_node(1, stubs[0].url, state="draining"), make_node(2, stubs[1].url, state="disabled"))
        await publish(aredis, redis_keys, make_snapshot(nodes))
        async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
            client = gateway.http
            response = await client.post(f"{gateway.url}/v1/chat/completions", json=BODY)
        error = assert_openai_error(response, 503, "ServiceUnavailableError")
        assert int(response.headers["retry-after"]) > 0
        assert "1 draining" in error["message"] and "1 disabled" in error["message"]

    async def test_it_retries_an_unreachable_node_once_on_another(self, aredis, redis_keys, redis_url, stubs):
        nodes = (make_node(1, closed_port_url(), name="dead"), make_node(2, stubs[0].url, name="alive"))
        await publish(aredis, redis_keys, make_snapshot(nodes))
        async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
            client = gateway.http
            answers = [await client.post(f"{gateway.url}/v1/chat/completions", json=BODY) for _ in range(4)]
            metrics = (await client.get(f"{gateway.url}/metrics")).text
        assert [answer.status_code for answer in answers] == [200] * 4
        assert {answer.headers["x-gorgo-node"] for answer in answers} == {"alive"}
        assert len(stubs[0].seen) == 4
        # the dead node refused once, then sat out its cool-down instead of costing every request
        assert 'gorgo_gateway_upstream_errors_total{kind="connect",node="dead"} 1.0' in metrics

    async def test_it_answers_502_when_the_retry_fails_too(self, aredis, redis_keys, redis_url):
        nodes = (
            make_node(1, closed_port_url(), name="dead-1"),
            make_node(2, closed_port_url(), name="dead-2"),
        )
        await publish(aredis, redis_keys, make_snapshot(nodes))
        async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
            client = gateway.http
            response = await client.post(f"{gateway.url}/v1/chat/completions", json={**BODY, "stream": True})
            metrics = (await client.get(f"{gateway.url}/metrics")).text
        assert "unreachable" in assert_openai_error(response, 502, "BadGatewayError")["message"]
        assert metrics.count('gorgo_gateway_upstream_errors_total{kind="connect"') == 2


class TestInternalErrors:
    async def test_it_hides_internal_failures_behind_a_500(self, aredis, redis_keys, redis_url, stubs):
        def broken(view, request):
            raise RuntimeError("secret internals")

        registry = {**REGISTRY, "round_robin": replace(REGISTRY["round_robin"], choose=broken)}
        await publish(aredis, redis_keys, make_snapshot((make_node(1, stubs[0].url),)))
        async with running_gateway(gateway_config(redis_keys, redis_url), registry=registry) as gateway:
            client = gateway.http
            response = await client.post(f"{gateway.url}/v1/chat/completions", json=BODY)
            after = await client.get(f"{gateway.url}/healthz")
        error = assert_openai_error(response, 500, "InternalServerError")
        assert "secret" not in response.text and response.headers["x-request-id"] in error["message"]
        assert after.status_code == 200  # the gateway keeps serving

    async def test_it_answers_503_until_a_policy_is_loaded(self, redis_keys, redis_url):
        async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
            client = gateway.http
            response = await client.post(f"{gateway.url}/v1/chat/completions", json=BODY)
            health = await client.get(f"{gateway.url}/healthz")
        assert_openai_error(response, 503, "ServiceUnavailableError")
        assert response.headers["retry-after"] == "1"
        assert health.status_code == 503 and health.json()["policy_version"] is None
