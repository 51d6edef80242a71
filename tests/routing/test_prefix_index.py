"""The approximate prefix index: chained chunk hashes, matching, LRU capacity, TTL, trust, sharing hooks."""

from __future__ import annotations

import os
import subprocess
import sys

import msgspec
import pytest

from routing.cache.approx_index import CHUNK_BYTES, ApproxPrefixIndex, chunk_hashes
from routing.cache.prompt import PrefixIndex
from routing.contract import SCHEMA_VERSION, PrefixUpdate
from tests.conftest import ROOT
from tests.routing.support import make_node

NOW_S = 1_700_000_000.0


def text(seed: str, chunks: int) -> str:
    """A prompt of exactly ``chunks`` full chunks whose every chunk differs (ASCII)."""
    return "".join(f"{seed}-{index:06d}-".ljust(CHUNK_BYTES, "x") for index in range(chunks))


def test_it_hashes_full_chunks_only_and_chains_them() -> None:
    base = text("a", 4)
    assert len(chunk_hashes(base)) == 4
    assert len(chunk_hashes(base + "partial")) == 4
    assert chunk_hashes("short") == []
    # Chained: a chunk's hash covers the whole prefix, so the same chunk after a different prefix
    # hashes differently.
    other = text("b", 1) + base[CHUNK_BYTES:]
    assert chunk_hashes(other)[1:] != chunk_hashes(base)[1:]
    assert chunk_hashes(base + text("c", 2))[:4] == chunk_hashes(base)


def test_it_hashes_the_same_in_another_process_with_another_hash_seed() -> None:
    prompt = text("stable", 3) + "é" * 300
    code = "import sys; from routing.cache.approx_index import chunk_hashes; print(chunk_hashes(sys.argv[1]))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    output = subprocess.run(
        [sys.executable, "-c", code, prompt], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    ).stdout
    assert output.strip() == str(chunk_hashes(prompt))


def test_it_matches_the_longest_prefix_each_node_holds() -> None:
    index = ApproxPrefixIndex(chars_per_token=4.0)
    conversation = text("conv", 10)
    index.insert_hashes(1, chunk_hashes(conversation), NOW_S)
    index.insert_hashes(2, chunk_hashes(conversation[: 3 * CHUNK_BYTES]), NOW_S)
    index.insert_hashes(3, chunk_hashes(conversation[: 7 * CHUNK_BYTES] + text("fork", 5)), NOW_S)
    index.insert_hashes(4, chunk_hashes(text("unrelated", 10)), NOW_S)

    longer = conversation + text("next-turn", 2)
    matched = index.match_hashes(chunk_hashes(longer), [1, 2, 3, 4, 5], NOW_S)

    tokens_per_chunk = CHUNK_BYTES // 4
    assert matched == {1: 10 * tokens_per_chunk, 2: 3 * tokens_per_chunk, 3: 7 * tokens_per_chunk}


def test_it_only_answers_for_the_nodes_asked() -> None:
    index = ApproxPrefixIndex()
    hashes = chunk_hashes(text("p", 4))
    index.insert_hashes(1, hashes, NOW_S)
    index.insert_hashes(2, hashes, NOW_S)
    assert set(index.match_hashes(hashes, [2, 3], NOW_S)) == {2}


def test_it_evicts_least_recently_sent_chunks_beyond_the_node_capacity() -> None:
    index = ApproxPrefixIndex(chars_per_token=4.0)
    tokens_per_chunk = CHUNK_BYTES // 4
    index.set_capacity(1, kv_capacity_tokens=8 * tokens_per_chunk)  # 8 chunks
    system = text("system", 4)
    first = system + text("first", 4)
    second = system + text("second", 4)
    index.insert_hashes(1, chunk_hashes(first), NOW_S)
    index.insert_hashes(1, chunk_hashes(second), NOW_S + 1)
    assert index.chunks_held(1) == 8

    # The shared system prompt was touched last of all, so the first request's tail went first.
    assert index.match_hashes(chunk_hashes(second), [1], NOW_S + 2) == {1: 8 * tokens_per_chunk}
    assert index.match_hashes(chunk_hashes(first), [1], NOW_S + 2) == {1: 4 * tokens_per_chunk}


def test_it_does_not_match_entries_older_than_the_ttl() -> None:
    index = ApproxPrefixIndex(ttl_s=60.0)
    hashes = chunk_hashes(text("old", 6))
    index.insert_hashes(1, hashes, NOW_S)
    index.insert_hashes(1, hashes[:2], NOW_S + 50)  # the first two chunks were sent again later

    assert index.match_hashes(hashes, [1], NOW_S + 59) == {1: 6 * index.chunk_tokens}
    assert index.match_hashes(hashes, [1], NOW_S + 100) == {1: 2 * index.chunk_tokens}
    assert index.match_hashes(hashes, [1], NOW_S + 200) == {}


def test_it_applies_other_gateways_updates_and_shares_only_its_own() -> None:
    index = ApproxPrefixIndex()
    own = chunk_hashes(text("own", 3))
    index.insert_hashes(1, own, NOW_S)
    remote = chunk_hashes(text("remote", 5))
    index.apply_remote(
        PrefixUpdate(
            schema_version=SCHEMA_VERSION, gateway_id="peer", node_id=2, chunk_hashes=tuple(remote), ts=NOW_S
        )
    )

    assert index.match_hashes(remote, [1, 2], NOW_S) == {2: 5 * index.chunk_tokens}
    assert index.take_updates() == [(1, tuple(own), NOW_S)]
    assert index.take_updates() == []


def test_it_resizes_and_forgets_nodes_when_the_fleet_changes() -> None:
    index = ApproxPrefixIndex(chars_per_token=4.0)
    tokens_per_chunk = CHUNK_BYTES // 4
    hashes = chunk_hashes(text("fleet", 20))
    for node_id in (1, 2):
        index.insert_hashes(node_id, hashes, NOW_S)

    small = msgspec.structs.replace(make_node(1), kv_capacity_tokens=5 * tokens_per_chunk)
    index.sync_nodes([small])  # node 2 left the fleet

    assert index.match_hashes(hashes, [1, 2], NOW_S) == {1: 5 * tokens_per_chunk}
    assert index.chunks_held(2) == 0
    assert index.capacity_chunks(1) == 5
    # A node that joins later starts empty, even if it inherits the departed node's internal slot.
    index.insert_hashes(3, hashes[:2], NOW_S)
    assert index.match_hashes(hashes, (1, 2, 3), NOW_S) == {1: 5 * tokens_per_chunk, 3: 2 * tokens_per_chunk}


def test_it_scales_credit_by_trust_and_lets_distrust_fade() -> None:
    index = ApproxPrefixIndex()
    hashes = chunk_hashes(text("trust", 8))
    index.insert_hashes(1, hashes, NOW_S)
    full = 8 * index.chunk_tokens
    for _ in range(5):
        index.observe(1, predicted_fraction=0.9, observed_fraction=0.0, now_s=NOW_S)

    distrusted = index.match_hashes(hashes, [1], NOW_S)[1]
    assert distrusted < 0.2 * full
    later = index.match_hashes(hashes, [1], NOW_S + 120)[1]  # four half-lives later
    assert distrusted < later <= full
    index.observe(1, predicted_fraction=0.0, observed_fraction=0.0, now_s=NOW_S)  # no prediction: no evidence
    assert index.trust(1, NOW_S) == pytest.approx(distrusted / full, abs=0.01)


def test_it_serves_the_gateway_hook_on_prompt_text() -> None:
    clock = [NOW_S]
    index: PrefixIndex = ApproxPrefixIndex(clock=lambda: clock[0], ttl_s=30.0)
    prompt = text("hook", 4) + "tail"
    index.insert(7, prompt)
    assert index.match([7, 8], prompt) == {7: 4 * CHUNK_BYTES // 4}
    clock[0] += 31
    assert index.match([7, 8], prompt) == {}
