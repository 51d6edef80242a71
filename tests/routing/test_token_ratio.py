"""The gateway learns the fleet tokenizer's characters per token from the nodes' usage reports."""

from __future__ import annotations

from routing.cache.approx_index import CHUNK_BYTES, ApproxPrefixIndex
from routing.cache.token_ratio import CHANGE_BAND, MIN_OBSERVATIONS, CharsPerToken
from routing.contract import GorgoParams, RequestRecord, decode
from simulator.fleet import Fleet
from simulator.topology import DEFAULT_TOPOLOGY_PATH, load_topology
from tests.routing.support import (
    MODEL,
    gateway_config,
    make_node,
    make_snapshot,
    publish,
    running_gateway,
    wait_for,
)


class TestCharsPerToken:
    def test_it_uses_the_prior_until_enough_requests_were_seen(self):
        ratio = CharsPerToken(4.0)
        for _ in range(MIN_OBSERVATIONS - 1):
            assert not ratio.observe(4_800, 1_000)
        assert ratio.value == 4.0 and ratio.learned is None
        assert ratio.observe(4_800, 1_000)  # the 20th: now it knows better
        assert abs(ratio.value - 4.8) < 1e-9

    def test_it_weighs_long_prompts_most(self):
        ratio = CharsPerToken(4.0)
        for index in range(MIN_OBSERVATIONS * 2):
            # Long prompts at 5 chars/token, short ones at 2: prefill cost is in the long ones.
            ratio.observe(50_000, 10_000) if index % 2 else ratio.observe(20, 10)
        assert 4.9 < ratio.value < 5.0

    def test_it_ignores_small_drifts_so_the_index_is_not_resized_for_nothing(self):
        ratio = CharsPerToken(4.0)
        changes = [
            ratio.observe(int(4_000 * (1 + CHANGE_BAND / 2)), 1_000) for _ in range(MIN_OBSERVATIONS * 3)
        ]
        assert not any(changes) and ratio.value == 4.0

    def test_it_follows_a_change_of_traffic(self):
        ratio = CharsPerToken(4.0)
        for _ in range(MIN_OBSERVATIONS):
            ratio.observe(4_800, 1_000)
        for _ in range(200):  # the traffic turns to a denser script
            ratio.observe(1_500, 1_000)
        assert abs(ratio.value - 1.5) < 0.05

    def test_it_restarts_from_a_new_prior_and_keeps_learning_on_the_same_one(self):
        ratio = CharsPerToken(4.0)
        for _ in range(MIN_OBSERVATIONS):
            ratio.observe(4_800, 1_000)
        assert not ratio.set_prior(4.0)  # the same policy republished: keep what was learned
        assert abs(ratio.value - 4.8) < 1e-9
        assert ratio.set_prior(3.0)  # the operator set a new ratio: start from it
        assert ratio.value == 3.0 and ratio.learned is None

    def test_it_ignores_empty_observations_and_clamps(self):
        ratio = CharsPerToken(4.0)
        assert not ratio.observe(0, 10) and not ratio.observe(10, 0)
        for _ in range(MIN_OBSERVATIONS):
            ratio.observe(100_000, 1)
        assert ratio.value == 20.0


async def test_it_learns_the_emulated_nodes_tokenizer_through_a_gateway(aredis, redis_keys, redis_url):
    # The simulator's tokenizer has ~5.5 characters per token on this text; the policy says 4.0.
    topology = load_topology(DEFAULT_TOPOLOGY_PATH)
    index = ApproxPrefixIndex()
    async with Fleet.start(topology, auto_ports=True, only=["us-east-1"]) as fleet:
        snapshot = make_snapshot((make_node(1, fleet.url("us-east-1")),), params=GorgoParams())
        await publish(aredis, redis_keys, snapshot)
        async with running_gateway(gateway_config(redis_keys, redis_url), prefix_index=index) as gateway:
            for number in range(MIN_OBSERVATIONS + 5):
                content = (
                    f"Request {number}: "
                    + "characteristically intercontinental telecommunications. " * (10 + number)
                )
                body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": content}]}
                assert (await gateway.http.post("/v1/chat/completions", json=body)).status_code == 200
            learned = gateway.app.chars_per_token.value
            metrics = (await gateway.http.get("/metrics")).text

            async def all_logged() -> bool:
                return await aredis.xlen(redis_keys.request_stream) >= MIN_OBSERVATIONS + 5

            await wait_for(all_logged)
    records = [decode(f[b"r"], RequestRecord) for _, f in await aredis.xrange(redis_keys.request_stream)]
    first, last = records[0], records[-1]
    assert first.prompt_tokens and last.prompt_tokens
    assert abs(first.prompt_tokens_est / first.prompt_tokens - 1) > 0.1  # the prior was off
    assert abs(last.prompt_tokens_est / last.prompt_tokens - 1) < 0.05  # the learned ratio is not
    assert learned != 4.0 and abs(index.chunk_tokens - CHUNK_BYTES / learned) < 1e-9  # the index follows
    assert f"gorgo_gateway_chars_per_token {learned}" in metrics
