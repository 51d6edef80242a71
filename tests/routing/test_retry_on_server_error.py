"""A node's server error (5xx) before any byte went to the client is retried on another node.

vLLM answers 500 "The engine is dead." while its engine goes down; in region-outage those answers
reached the clients of a region whose other nodes (and the regions next door) were fine.
"""

from __future__ import annotations

import re

import pytest

from tests.routing.support import MODEL, gateway_config, make_node, make_snapshot, publish, running_gateway
from tests.support.vllm_stub import stub_nodes

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True}


def counter(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


@pytest.mark.parametrize("status", [500, 503])
async def test_it_answers_from_another_node_when_one_answers_a_server_error(
    aredis, redis_keys, redis_url, status
):
    async with stub_nodes("dying", "fine") as (dying, fine):
        dying.api_status = status
        snapshot = make_snapshot((make_node(1, dying.url, name="dying"), make_node(2, fine.url, name="fine")))
        await publish(aredis, redis_keys, snapshot)
        async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
            answers = [await gateway.http.post("/v1/chat/completions", json=BODY) for _ in range(4)]
            metrics = (await gateway.http.get("/metrics")).text
    assert [(a.status_code, a.headers["x-gorgo-node"]) for a in answers] == [(200, "fine")] * 4
    assert len(dying.seen) >= 1  # it was tried (and its breaker counts the failure)
    assert counter(metrics, 'gorgo_gateway_retries_total{reason="status"}') == len(dying.seen)


async def test_the_only_nodes_server_error_reaches_the_client(aredis, redis_keys, redis_url):
    async with stub_nodes("only") as (only,):
        only.api_status = 500
        await publish(aredis, redis_keys, make_snapshot((make_node(1, only.url, name="only"),)))
        async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
            answer = await gateway.http.post("/v1/chat/completions", json=BODY)
    assert answer.status_code == 500
    assert len(only.seen) == 1


async def test_a_501_is_not_retried(aredis, redis_keys, redis_url):
    async with stub_nodes("a", "b") as (a, b):
        await publish(
            aredis, redis_keys, make_snapshot((make_node(1, a.url, name="a"), make_node(2, b.url, name="b")))
        )
        async with running_gateway(gateway_config(redis_keys, redis_url)) as gateway:
            body = {**BODY, "stub": {"status": 501}}  # the same on every node: nothing to gain
            answers = [await gateway.http.post("/v1/chat/completions", json=body) for _ in range(4)]
    assert [answer.status_code for answer in answers] == [501] * 4
    assert len(a.seen) + len(b.seen) == 4
