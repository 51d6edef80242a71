"""Bad input gets vLLM's error shape and status codes."""

from __future__ import annotations

import httpx
import pytest
from openai import AsyncOpenAI, BadRequestError, NotFoundError

from tests.simulator.conftest import MODEL, FleetFactory, chat_body


def assert_error_shape(response: httpx.Response, status: int, err_type: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == err_type
    assert error["code"] == status
    return error["message"]


async def test_it_answers_404_for_an_unknown_model(make_fleet: FleetFactory, http: httpx.AsyncClient) -> None:
    fleet = await make_fleet()
    response = await http.post(
        f"{fleet.url('node-a')}/v1/chat/completions", json={**chat_body("Hi"), "model": "gpt-nope"}
    )
    message = assert_error_shape(response, 404, "NotFoundError")
    assert message == "The model `gpt-nope` does not exist."


async def test_it_answers_400_for_malformed_json(make_fleet: FleetFactory, http: httpx.AsyncClient) -> None:
    fleet = await make_fleet()
    response = await http.post(
        f"{fleet.url('node-a')}/v1/completions",
        content=b'{"model": "x", "prompt": ',
        headers={"Content-Type": "application/json"},
    )
    assert_error_shape(response, 400, "BadRequestError")


@pytest.mark.parametrize(
    "patch",
    [
        {"max_tokens": 0},
        {"max_tokens": "ten"},
        {"temperature": -1},
        {"messages": "hello"},
        {"messages": [{"content": "no role"}]},
        {"messages": []},
        {"stream": "yes"},
        {"n": 2},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    ],
)
async def test_it_answers_400_for_invalid_fields(
    make_fleet: FleetFactory, http: httpx.AsyncClient, patch: dict[str, object]
) -> None:
    fleet = await make_fleet()
    response = await http.post(
        f"{fleet.url('node-a')}/v1/chat/completions", json={**chat_body("Hi"), **patch}
    )
    assert_error_shape(response, 400, "BadRequestError")


async def test_it_rejects_max_tokens_beyond_the_context_with_vllms_message(
    make_fleet: FleetFactory, http: httpx.AsyncClient
) -> None:
    fleet = await make_fleet(max_model_len=4096)
    response = await http.post(
        f"{fleet.url('node-a')}/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 4095}
    )
    message = assert_error_shape(response, 400, "BadRequestError")
    assert message == (
        "'max_tokens' or 'max_completion_tokens' is too large: 4095. This model's maximum context "
        "length is 4096 tokens and your request has 2 input tokens (4095 > 4096 - 2)."
    )


async def test_it_rejects_a_prompt_longer_than_the_context(
    make_fleet: FleetFactory, http: httpx.AsyncClient
) -> None:
    fleet = await make_fleet(max_model_len=4096)
    response = await http.post(
        f"{fleet.url('node-a')}/v1/completions", json={"model": MODEL, "prompt": [7] * 5000, "max_tokens": 1}
    )
    message = assert_error_shape(response, 400, "BadRequestError")
    assert message.startswith(
        "This model's maximum context length is 4096 tokens. However, your request has 5000"
    )


async def test_it_surfaces_errors_through_the_openai_client(make_fleet: FleetFactory) -> None:
    fleet = await make_fleet()
    async with AsyncOpenAI(base_url=f"{fleet.url('node-a')}/v1", api_key="unused", max_retries=0) as client:
        with pytest.raises(NotFoundError):
            await client.chat.completions.create(model="other", messages=[{"role": "user", "content": "Hi"}])
        with pytest.raises(BadRequestError):
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=100_000
            )


async def test_it_answers_404_for_unknown_paths(make_fleet: FleetFactory, http: httpx.AsyncClient) -> None:
    fleet = await make_fleet()
    assert (await http.get(f"{fleet.url('node-a')}/v1/nothing")).status_code == 404
    assert (await http.get(f"{fleet.url('node-a')}/v1/chat/completions")).status_code == 405
