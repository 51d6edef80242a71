"""Per-node admission and the bounded priority queue: interactive before batch, never unbounded."""

from __future__ import annotations

import asyncio

import msgspec

from tests.routing.support import (
    MODEL,
    gateway_config,
    make_key,
    make_node,
    make_snapshot,
    publish,
    publish_keys,
    running_gateway,
    wait_for,
)

INTERACTIVE = "gorgo-sk-ia-interactive-secret"
BATCH = "gorgo-sk-ba-batch-secret"


def body(tag: str, delay_s: float = 0.0) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": tag}],
        "stub": {"delay_s": delay_s},
    }


def auth(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def one_slot_node(aredis, redis_keys, stubs) -> None:
    node = msgspec.structs.replace(make_node(1, stubs[0].url), max_num_seqs=1)
    await publish(aredis, redis_keys, make_snapshot((node,)))
    await publish_keys(
        aredis,
        redis_keys,
        make_key(INTERACTIVE, key_id="ia"),
        make_key(BATCH, key_id="ba", priority="batch"),
    )


class TestAdmission:
    async def test_interactive_requests_go_before_batch_ones_under_saturation(
        self, aredis, redis_keys, redis_url, stubs
    ):
        await one_slot_node(aredis, redis_keys, stubs)
        config = gateway_config(redis_keys, redis_url, auth="on", admission_factor=1.0, queue_max_wait_s=10)
        async with running_gateway(config) as gateway:
            post = gateway.http.post
            gateway_inflight = gateway.app.runtime.inflight
            first = asyncio.create_task(
                # Holds the one slot while the six queue: 0.3 s was not always enough on a busy
                # machine (three test workers on two cores), and the queue drained before it filled.
                post("/v1/chat/completions", json=body("first", 2.0), headers=auth(BATCH))
            )
            await wait_for(lambda: gateway_inflight.outstanding(1) == 1)
            queued = []
            for index in range(3):  # batch first, then interactive: the queue reorders them
                queued.append(
                    asyncio.create_task(
                        post("/v1/chat/completions", json=body(f"b{index}"), headers=auth(BATCH))
                    )
                )
                await asyncio.sleep(0.02)
            for index in range(3):
                queued.append(
                    asyncio.create_task(
                        post("/v1/chat/completions", json=body(f"i{index}"), headers=auth(INTERACTIVE))
                    )
                )
                await asyncio.sleep(0.02)
            await wait_for(lambda: sum(gateway.app.runtime.proxy._admission.lengths().values()) == 6)
            metrics_during = (await gateway.http.get("/metrics")).text
            answers = await asyncio.gather(first, *queued)
        assert [answer.status_code for answer in answers] == [200] * 7
        order = [seen.body["messages"][0]["content"] for seen in stubs[0].seen]
        assert order == ["first", "i0", "i1", "i2", "b0", "b1", "b2"]
        assert 'gorgo_gateway_queue_length{priority="batch"} 3.0' in metrics_during
        assert 'gorgo_gateway_queue_length{priority="interactive"} 3.0' in metrics_during

    async def test_the_queue_is_bounded_in_length_and_in_time(self, aredis, redis_keys, redis_url, stubs):
        await one_slot_node(aredis, redis_keys, stubs)
        config = gateway_config(
            redis_keys, redis_url, auth="on", admission_factor=1.0, queue_max_length=2, queue_max_wait_s=0.3
        )
        async with running_gateway(config) as gateway:
            post = gateway.http.post
            busy = asyncio.create_task(
                post("/v1/chat/completions", json=body("busy", 1.0), headers=auth(BATCH))
            )
            await wait_for(lambda: gateway.app.runtime.inflight.outstanding(1) == 1)
            waiting = [
                asyncio.create_task(post("/v1/chat/completions", json=body(f"w{i}"), headers=auth(BATCH)))
                for i in range(2)
            ]
            await wait_for(lambda: sum(gateway.app.runtime.proxy._admission.lengths().values()) == 2)
            over = await post("/v1/chat/completions", json=body("over"), headers=auth(BATCH))
            timed_out = await asyncio.gather(*waiting)
            await busy
            metrics = (await gateway.http.get("/metrics")).text
        assert over.status_code == 503 and over.headers["retry-after"] == "1"
        assert [answer.status_code for answer in timed_out] == [503, 503]
        assert 'gorgo_gateway_queue_rejected_total{priority="batch",reason="full"} 1.0' in metrics
        assert 'gorgo_gateway_queue_rejected_total{priority="batch",reason="timeout"} 2.0' in metrics

    async def test_an_interactive_arrival_at_a_full_queue_displaces_the_newest_batch_waiter(
        self, aredis, redis_keys, redis_url, stubs
    ):
        await one_slot_node(aredis, redis_keys, stubs)
        config = gateway_config(
            redis_keys, redis_url, auth="on", admission_factor=1.0, queue_max_length=1, queue_max_wait_s=5
        )
        async with running_gateway(config) as gateway:
            post = gateway.http.post
            busy = asyncio.create_task(
                post("/v1/chat/completions", json=body("busy", 0.3), headers=auth(BATCH))
            )
            await wait_for(lambda: gateway.app.runtime.inflight.outstanding(1) == 1)
            batch = asyncio.create_task(post("/v1/chat/completions", json=body("b"), headers=auth(BATCH)))
            await wait_for(lambda: sum(gateway.app.runtime.proxy._admission.lengths().values()) == 1)
            interactive = await post("/v1/chat/completions", json=body("i"), headers=auth(INTERACTIVE))
            assert (await batch).status_code == 503
            await busy
        assert interactive.status_code == 200

    async def test_a_waiter_whose_node_left_the_policy_meanwhile_is_routed_on_the_new_one(
        self, aredis, redis_keys, redis_url, stubs
    ):
        # The queue granted the waiter the node it was waiting for, and the request went there
        # with the table it started with: a node removed (drained) while it waited still got it.
        await one_slot_node(aredis, redis_keys, stubs)
        config = gateway_config(redis_keys, redis_url, auth="on", admission_factor=1.0, queue_max_wait_s=10)
        async with running_gateway(config) as gateway:
            post = gateway.http.post
            busy = asyncio.create_task(
                post("/v1/chat/completions", json=body("busy", 0.5), headers=auth(BATCH))
            )
            await wait_for(lambda: gateway.app.runtime.inflight.outstanding(1) == 1)
            waiting = asyncio.create_task(
                post("/v1/chat/completions", json=body("waiting"), headers=auth(INTERACTIVE))
            )
            await wait_for(lambda: sum(gateway.app.runtime.proxy._admission.lengths().values()) == 1)
            replacement = msgspec.structs.replace(make_node(2, stubs[1].url, name="gpu-b"), max_num_seqs=1)
            await publish(aredis, redis_keys, make_snapshot((replacement,), version=2))
            await wait_for(lambda: gateway.app.runtime.store.table.version == 2)
            answer = await waiting
            await busy
        assert answer.status_code == 200 and answer.headers["x-gorgo-node"] == "gpu-b"
        assert [seen.body["messages"][0]["content"] for seen in stubs[0].seen] == ["busy"]
