"""Prefix caching: a repeated prompt hits, enough other traffic evicts it, hits are counted in tokens."""

from __future__ import annotations

import random

import httpx

from simulator.kv_cache import KVBlockPool, extend_block_hashes
from simulator.text import text_of_tokens
from tests.simulator.conftest import FleetFactory, bare_engine, chat_body, run_to_end
from tests.simulator.test_metrics_exposition import key, scrape


async def ask(http: httpx.AsyncClient, url: str, text: str) -> dict[str, int]:
    response = await http.post(f"{url}/v1/chat/completions", json=chat_body(text, max_tokens=2))
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    return {"prompt": usage["prompt_tokens"], "cached": usage["prompt_tokens_details"]["cached_tokens"]}


async def test_it_hits_on_a_repeated_prompt_and_misses_after_eviction(
    make_fleet: FleetFactory, http: httpx.AsyncClient
) -> None:
    # 64 blocks of 16 tokens: room for about three 300-token prompts.
    fleet = await make_fleet(kv_capacity_blocks=64, max_model_len=1024)
    url = fleet.url("node-a")
    rng = random.Random(5)
    prompt = text_of_tokens(rng, 300)
    hits = key("vllm:prefix_cache_hits_total")

    first = await ask(http, url, prompt)
    assert first["cached"] == 0

    before_repeat = await scrape(http, url)
    repeat = await ask(http, url, prompt)
    after_repeat = await scrape(http, url)
    # Whole 16-token blocks, never the last token: vLLM's hit accounting.
    assert repeat["cached"] == (repeat["prompt"] - 1) // 16 * 16
    assert after_repeat[hits] - before_repeat[hits] == repeat["cached"]

    for _ in range(6):  # ~1800 tokens of other prompts through a 1024-token cache
        other = await ask(http, url, text_of_tokens(rng, 300))
        assert other["cached"] == 0

    before_evicted = await scrape(http, url)
    evicted = await ask(http, url, prompt)
    after_evicted = await scrape(http, url)
    assert evicted["cached"] == 0
    assert after_evicted[hits] - before_evicted[hits] == 0


async def test_it_shares_a_common_prefix_between_different_prompts(
    make_fleet: FleetFactory, http: httpx.AsyncClient
) -> None:
    fleet = await make_fleet()
    url = fleet.url("node-a")
    system = text_of_tokens(random.Random(9), 500)
    body_a = {"model": chat_body("")["model"], "max_tokens": 2}
    first = await http.post(
        f"{url}/v1/chat/completions",
        json={
            **body_a,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "One?"}],
        },
    )
    second = await http.post(
        f"{url}/v1/chat/completions",
        json={
            **body_a,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Two?"}],
        },
    )
    assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 480 <= cached < second.json()["usage"]["prompt_tokens"]


def blocks_for(tokens: list[int], block_size: int = 4) -> list[int]:
    hashes: list[int] = []
    extend_block_hashes(hashes, tokens, block_size, len(tokens) // block_size)
    return hashes


def test_it_chains_block_hashes_so_equal_blocks_after_different_prefixes_differ() -> None:
    a = blocks_for([1, 2, 3, 4, 9, 9, 9, 9])
    b = blocks_for([5, 6, 7, 8, 9, 9, 9, 9])
    assert a[0] != b[0]
    assert a[1] != b[1]
    assert blocks_for([1, 2, 3, 4, 9, 9, 9, 9]) == a


def test_it_evicts_the_least_recently_freed_block_and_a_prefix_last() -> None:
    pool = KVBlockPool(num_blocks=4, block_size=4)
    hashes = blocks_for(list(range(16)))
    entries = pool.allocate(4)
    assert entries is not None
    for i, block_hash in enumerate(hashes):
        entries[i] = pool.publish(block_hash)
    assert pool.usage == 1.0
    pool.release(entries)
    assert pool.usage == 0.0
    assert pool.match_prefix(hashes, 4) == 4  # freed blocks stay cached

    # One new block evicts the request's tail block, not its prefix.
    assert pool.allocate(1) is not None
    assert pool.match_prefix(hashes, 4) == 3
    assert not pool.is_cached(hashes[3])

    # Blocks a request hits are referenced again, so they cannot be evicted meanwhile.
    held = pool.acquire_cached(hashes[:2])
    assert pool.allocate(2) is None  # only hashes[2] is evictable
    assert pool.allocate(1) is not None
    assert not pool.is_cached(hashes[2])
    assert pool.match_prefix(hashes, 4) == 2
    pool.release(held)
    assert pool.num_free_blocks == 2


def test_it_refuses_allocation_when_every_block_is_referenced() -> None:
    pool = KVBlockPool(num_blocks=2, block_size=16)
    assert pool.allocate(2) is not None
    assert pool.allocate(1) is None
    assert pool.num_free_blocks == 0


def test_a_block_computed_twice_at_once_is_cached_twice_and_evicted_copy_by_copy() -> None:
    # vLLM does not de-duplicate (block_pool.py, BlockHashToBlockMap NOTE #1): two requests that
    # compute the same block each cache a copy under its hash; each copy is evicted on its own.
    # The emulator kept the second private and never announced it.
    pool = KVBlockPool(num_blocks=3, block_size=4)
    pool.evicted = []
    (block_hash,) = blocks_for([1, 2, 3, 4])
    first, second = pool.allocate(1), pool.allocate(1)
    assert first is not None and second is not None
    first[0], second[0] = pool.publish(block_hash), pool.publish(block_hash)
    assert first[0] != second[0] and pool.copies(block_hash) == 2
    pool.release(first)
    pool.release(second)
    assert pool.num_cached_blocks == 2 and pool.num_free_blocks == 3
    hit = pool.acquire_cached([block_hash])
    assert hit == first  # the oldest copy, as vLLM's get_one_block
    assert pool.allocate(2) is not None  # the free block, then the other copy
    assert pool.evicted == [block_hash] and pool.is_cached(block_hash)
    pool.release(hit)
    assert pool.allocate(1) is not None
    assert pool.evicted == [block_hash, block_hash] and not pool.is_cached(block_hash)


async def test_a_request_scheduled_in_the_same_step_hits_the_blocks_the_first_is_computing() -> None:
    # vLLM caches a block when the step that computes it is scheduled (kv_cache_manager.py,
    # allocate_slots -> cache_blocks), so a request scheduled after it in the same step hits it.
    # The emulator cached blocks when the step ended: both computed the whole prompt.
    engine = bare_engine(kv_capacity_blocks=64, max_model_len=256, max_num_batched_tokens=1024)
    prompt = list(range(1, 65))  # 4 full blocks; at most 3 can be hits (the last token is computed)
    first = engine.add_request("a", prompt, max_tokens=2, ignore_eos=True)
    second = engine.add_request("b", prompt, max_tokens=2, ignore_eos=True)
    await run_to_end(engine, [first, second], timeout_s=10)
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 48)
