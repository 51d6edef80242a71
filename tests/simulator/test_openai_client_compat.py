"""The official openai client works against an emulated node, and streams arrive token by token."""

from __future__ import annotations

import json
import time

import httpx
from openai import AsyncOpenAI

from tests.simulator.conftest import MODEL, FleetFactory, chat_body


def client_for(url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


async def test_it_answers_a_chat_completion(make_fleet: FleetFactory) -> None:
    fleet = await make_fleet()
    async with client_for(fleet.url("node-a")) as client:
        response = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=5
        )
    assert response.object == "chat.completion"
    assert response.model == MODEL
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content
    assert response.choices[0].finish_reason == "length"
    assert response.usage is not None
    assert response.usage.completion_tokens == 5
    assert response.usage.prompt_tokens > 5
    assert response.usage.total_tokens == response.usage.prompt_tokens + 5


async def test_it_streams_a_chat_completion_incrementally(make_fleet: FleetFactory) -> None:
    # 20 ms decode steps make each token a separate event the client can see.
    fleet = await make_fleet(decode_step_base_ms=20.0)
    received: list[tuple[float, object]] = []
    async with client_for(fleet.url("node-a")) as client:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Count to eight."}],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            received.append((time.perf_counter(), chunk))

    chunks = [chunk for _, chunk in received]
    assert chunks[0].choices[0].delta.role == "assistant"
    contents = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(contents) == 8
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8

    content_times = [t for t, c in received if c.choices and c.choices[0].delta.content]
    # Incremental: tokens arrive at different moments, the first well before the end
    # (7 more decode steps of 20 ms follow it).
    assert len({round(t, 3) for t in content_times}) >= 4
    assert received[-1][0] - content_times[0] >= 0.07


async def test_it_answers_a_completion_with_and_without_streaming(make_fleet: FleetFactory) -> None:
    fleet = await make_fleet()
    async with client_for(fleet.url("node-a")) as client:
        response = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4)
        assert response.object == "text_completion"
        assert response.choices[0].text
        assert response.usage is not None
        assert response.usage.prompt_tokens == 5  # <|begin_of_text|> + 4 words
        assert response.usage.completion_tokens == 4

        stream = await client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=4, stream=True
        )
        texts = [chunk.choices[0].text async for chunk in stream if chunk.choices]
    assert "".join(texts) == response.choices[0].text  # same prompt, same emulated answer


async def test_it_lists_the_served_model(make_fleet: FleetFactory) -> None:
    fleet = await make_fleet()
    async with client_for(fleet.url("node-a")) as client:
        models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "vllm"


async def test_it_streams_server_sent_events_in_vllms_layout(
    make_fleet: FleetFactory, http: httpx.AsyncClient
) -> None:
    fleet = await make_fleet()
    body = chat_body("Hi", max_tokens=3, stream=True, stream_options={"include_usage": True})
    response = await http.post(f"{fleet.url('node-a')}/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["x-gorgo-sim-node"] == "node-a"
    events = response.text.split("\n\n")
    assert events[-1] == ""
    assert events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert {p["object"] for p in payloads} == {"chat.completion.chunk"}
    assert len({p["id"] for p in payloads}) == 1
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [p["choices"][0]["finish_reason"] for p in payloads[1:-1]] == [None, None, None, "length"]
    assert payloads[-1]["choices"] == []
    assert payloads[-1]["usage"]["completion_tokens"] == 3
    assert payloads[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_it_answers_health_with_an_empty_200(make_fleet: FleetFactory, http: httpx.AsyncClient) -> None:
    fleet = await make_fleet()
    response = await http.get(f"{fleet.url('node-a')}/health")
    assert response.status_code == 200
    assert response.content == b""
