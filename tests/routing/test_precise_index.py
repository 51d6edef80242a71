"""The precise index: content keys from token ids, per-node block sets, prefix matches."""

from __future__ import annotations

import random
from array import array

from routing.cache.approx_index import ApproxPrefixIndex
from routing.cache.kv_aware_index import ANCHOR_BLOCKS, KVAwareIndex
from routing.cache.precise_index import PreciseIndex, Tenant, block_keys


def tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(128_000) for _ in range(count)]


def test_it_keys_blocks_by_content_whatever_the_engine_hashes() -> None:
    index = PreciseIndex()
    prompt = tokens(1, 64)  # 4 blocks
    index.store(1, [b"a1", b"a2"], None, prompt[:32], 16)  # node 1's engine: one random root
    index.store(1, [b"a3"], b"a2", prompt[32:48], 16)
    index.store(2, [901, 902, 903, 904], None, prompt, 16)  # node 2's engine: another
    keys = block_keys(prompt, 16)
    assert index.match_keys(keys, [1, 2], 16) == {1: 48, 2: 64}
    index.remove(2, [904, 903])
    assert index.match_keys(keys, [1, 2], 16) == {1: 48, 2: 32}
    index.clear(1)
    assert index.match_keys(keys, [1, 2], 16) == {2: 32}
    assert index.blocks(1) == 0 and index.blocks(2) == 2


def test_a_different_prefix_never_matches_the_same_block_tokens() -> None:
    index = PreciseIndex()
    first, second = tokens(1, 16), tokens(2, 16)
    index.store(1, [1, 2], None, first + second, 16)
    assert index.match_keys(block_keys(second + second, 16), [1], 16) == {}


def test_a_block_with_an_unknown_parent_is_not_keyed() -> None:
    index = PreciseIndex()
    assert index.store(1, [5], 4, tokens(1, 16), 16) == 1
    assert index.blocks(1) == 0


class _Subscriber:
    def mode(self, now_s: float) -> str:
        return "precise"


class _Events:
    """KVEvents as when nodes 1-8 each have a subscriber whose events are current (precise)."""

    def __init__(self, index: PreciseIndex) -> None:
        self.index = index
        self.subscribers: dict = {node_id: _Subscriber() for node_id in range(1, 9)}

    def mode(self, node_id: int, now_s: float | None = None) -> str:
        return "precise"


def test_new_turns_reuse_the_keys_of_the_prompt_they_extend() -> None:
    index = KVAwareIndex(ApproxPrefixIndex(), _Events(PreciseIndex()))  # type: ignore[arg-type]
    history = tokens(3, ANCHOR_BLOCKS * 16 * 3 + 5)
    for turn in range(4):
        prompt = array("I", history + tokens(10 + turn, 100 * turn + 7))
        count = (len(prompt) - 1) // 16
        assert index._keys_for(prompt, 16, count) == block_keys(prompt, 16, count)


def test_a_prompt_sent_to_a_node_counts_as_held_until_its_events_arrive() -> None:
    precise = PreciseIndex()
    clock = [1000.0]
    index = KVAwareIndex(ApproxPrefixIndex(), _Events(precise), clock=lambda: clock[0])  # type: ignore[arg-type]
    prompt = array("I", tokens(4, 16 * 6 + 1))
    assert index.match([1], "text", prompt) == {}
    index.insert(1, "text")
    assert index.match([1], "text", prompt) == {1: 96}  # in flight
    precise.store(1, [1, 2, 3, 4, 5, 6], None, prompt[:96], 16)
    precise.remove(1, [6, 5, 4])  # computed, then partly evicted: the events now speak
    assert index.match([1], "text", prompt) == {1: 48}
    clock[0] += 10
    assert index.match([1], "text", prompt) == {1: 48}


def test_a_prompt_routed_before_its_tokens_were_known_still_counts_as_in_flight() -> None:
    precise = PreciseIndex()
    index = KVAwareIndex(ApproxPrefixIndex(), _Events(precise))  # type: ignore[arg-type]
    text = "system prompt words " * 100
    assert index.match([1, 2], text) == {}  # no ids yet (a long new segment): estimated
    index.insert(1, text)
    prompt = array("I", tokens(5, 16 * 20 + 1))
    matched = index.match([1, 2], text, prompt)  # tokenized now; node 1 is still computing it
    assert set(matched) == {1} and matched[1] > 0


def test_a_salted_tenants_blocks_match_only_its_own_prompts() -> None:
    # vLLM 0.32: the salt is on the first block's extra_keys only; the chain carries it on.
    index = PreciseIndex()
    prompt = tokens(3, 64)
    index.store(1, [11, 12], None, prompt[:32], 16, [["tenant-a"], None])
    index.store(1, [13, 14], 12, prompt[32:], 16, [None, None])
    index.store(2, [21, 22, 23, 24], None, prompt, 16)  # no salt
    salted = block_keys(prompt, 16, tenant=Tenant(cache_salt="tenant-a"))
    assert index.match_keys(salted, [1, 2], 16) == {1: 64}
    assert index.match_keys(block_keys(prompt, 16), [1, 2], 16) == {2: 64}
    assert index.match_keys(block_keys(prompt, 16, tenant=Tenant(cache_salt="tenant-b")), [1, 2], 16) == {}


def test_a_lora_adapters_blocks_are_its_own() -> None:
    # The adapter's name is first in every block's extra_keys (and in lora_name); an older vLLM
    # without extra_keys gives lora_name only, which stands for the same.
    index = PreciseIndex()
    prompt = tokens(4, 48)
    index.store(1, [1, 2, 3], None, prompt, 16, [["sql-lora", "s"], ["sql-lora"], ["sql-lora"]], "sql-lora")
    index.store(2, [1, 2, 3], None, prompt, 16, None, "sql-lora")
    index.store(3, [1, 2, 3], None, prompt, 16)
    both = block_keys(prompt, 16, tenant=Tenant("sql-lora", "s"))
    assert index.match_keys(both, [1, 2, 3], 16) == {1: 48}
    assert index.match_keys(block_keys(prompt, 16, tenant=Tenant("sql-lora")), [1, 2, 3], 16) == {2: 48}
    assert index.match_keys(block_keys(prompt, 16), [1, 2, 3], 16) == {3: 48}


def test_the_key_cache_keeps_tenants_apart() -> None:
    from routing.cache.kv_events.manager import KVEvents

    index = KVAwareIndex(ApproxPrefixIndex(), KVEvents())
    prompt = array("I", tokens(5, 16 * (ANCHOR_BLOCKS + 2)))
    plain = index._keys_for(prompt, 16, ANCHOR_BLOCKS + 1)
    salted = index._keys_for(prompt, 16, ANCHOR_BLOCKS + 1, Tenant(cache_salt="x"))
    assert salted == block_keys(prompt, 16, ANCHOR_BLOCKS + 1, Tenant(cache_salt="x")) != plain


def test_a_block_cached_twice_is_held_until_both_copies_are_evicted() -> None:
    # vLLM does not de-duplicate cached blocks (vllm/v1/core/block_pool.py, BlockHashToBlockMap,
    # NOTE #1): two requests computing the same prefix at once each cache their own copy, and each
    # copy has its BlockStored and, when evicted, its BlockRemoved. One eviction leaves a copy that
    # the next request hits.
    index = PreciseIndex()
    prompt = tokens(6, 48)
    index.store(1, [1, 2, 3], None, prompt, 16)  # request A
    index.store(1, [2, 3], 1, prompt[16:], 16)  # request B hit block 1, computed its own 2 and 3
    keys = block_keys(prompt, 16)
    index.remove(1, [3, 2])  # A's copies are evicted first (freed first)
    assert index.match_keys(keys, [1], 16) == {1: 48}  # B's copies are still cached
    assert index.blocks(1) == 3
    index.remove(1, [3, 2])
    assert index.match_keys(keys, [1], 16) == {1: 16}
    index.store(1, [2], 1, prompt[16:32], 16)
    index.clear(1)  # AllBlocksCleared: every copy goes
    index.store(1, [2], 1, prompt[16:32], 16)  # parent 1 is gone: not keyed
    assert index.blocks(1) == 0
