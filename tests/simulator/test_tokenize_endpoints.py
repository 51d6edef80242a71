"""vLLM's tokenizer endpoints (``/tokenize``, ``/v1/*/render``): the token ids the engine would see.

Routers call them before routing (the Rust vllm-router's cache_aware policy renders every chat
request on its workers), so their answers must agree with what generation counts.
"""

from __future__ import annotations

import httpx

from tests.simulator.conftest import MODEL, FleetFactory, chat_body

MESSAGES = [
    {"role": "system", "content": "You route requests between regions. " * 20},
    {"role": "user", "content": "Which node is closest?"},
]


async def prompt_tokens_of(http: httpx.AsyncClient, url: str, path: str, body: dict) -> int:
    response = await http.post(f"{url}{path}", json={**body, "max_tokens": 1})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens"]


async def test_it_tokenizes_chat_messages_as_generation_does(
    make_fleet: FleetFactory, http: httpx.AsyncClient
) -> None:
    url = (await make_fleet()).url("node-a")
    response = await http.post(f"{url}/tokenize", json={"model": MODEL, "messages": MESSAGES})
    assert response.status_code == 200
    answer = response.json()
    expected = await prompt_tokens_of(
        http, url, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES}
    )
    assert answer["count"] == len(answer["tokens"]) == expected
    assert answer["max_model_len"] == 4096 and all(isinstance(token, int) for token in answer["tokens"])


async def test_it_tokenizes_a_prompt_as_completions_do(
    make_fleet: FleetFactory, http: httpx.AsyncClient
) -> None:
    url = (await make_fleet()).url("node-a")
    prompt = "Tokens, blocks and caches. " * 30
    answer = (await http.post(f"{url}/tokenize", json={"prompt": prompt})).json()
    assert answer["count"] == await prompt_tokens_of(
        http, url, "/v1/completions", {"model": MODEL, "prompt": prompt}
    )
    bare = (await http.post(f"{url}/tokenize", json={"prompt": prompt, "add_special_tokens": False})).json()
    assert bare["count"] == answer["count"] - 1  # no <|begin_of_text|>


async def test_it_renders_a_chat_request_to_token_ids(
    make_fleet: FleetFactory, http: httpx.AsyncClient
) -> None:
    url = (await make_fleet()).url("node-a")
    body = chat_body("unused", max_tokens=7) | {"messages": MESSAGES}
    rendered = (await http.post(f"{url}/v1/chat/completions/render", json=body)).json()
    tokenized = (await http.post(f"{url}/tokenize", json={"messages": MESSAGES})).json()
    assert rendered["token_ids"] == tokenized["tokens"]
    assert rendered["sampling_params"]["max_tokens"] == 7 and rendered["model"] == MODEL
    (completion,) = (
        await http.post(f"{url}/v1/completions/render", json={"model": MODEL, "prompt": "Hello there"})
    ).json()
    assert len(completion["token_ids"]) == await prompt_tokens_of(
        http, url, "/v1/completions", {"model": MODEL, "prompt": "Hello there"}
    )


async def test_it_refuses_unknown_models_and_empty_requests(
    make_fleet: FleetFactory, http: httpx.AsyncClient
) -> None:
    url = (await make_fleet()).url("node-a")
    unknown = await http.post(f"{url}/tokenize", json={"model": "other", "prompt": "x"})
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "NotFoundError"
    empty = await http.post(f"{url}/tokenize", json={"model": MODEL})
    assert empty.status_code == 400
    bad = await http.post(f"{url}/v1/chat/completions/render", json={"model": MODEL, "messages": "no"})
    assert bad.status_code == 400
