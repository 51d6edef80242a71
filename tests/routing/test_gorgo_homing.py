"""gorgo brings a prompt family home once its region has paid for it abroad (issue 24).

The trap (docs/routing.md, "Bringing a prefix home"): a region's system prompt cached on a node
in another region and on none at home makes every request of the family cheaper abroad (one round
trip against the whole prefix's prefill at home), so each goes abroad, the prefix is never cached
at home, and the region's clients pay the round trip for as long as the family lives. With
``homing_rent_ratio = 0`` (gorgo before this change) that is what happens; with the default each
forward pays rent and, once paid up, one request stays home and the family follows it.
"""

from __future__ import annotations

import msgspec
import pytest

from routing.algorithms import gorgo
from routing.algorithms.base import NodeLoad, PrefixRent, RoutingRequest, RoutingView
from routing.cache.approx_index import CHUNK_BYTES, ApproxPrefixIndex
from routing.cache.prompt import parse_body
from routing.contract import GorgoParams, RequestRecord, decode
from routing.state.homing import FADE_STEP_S, MAX_PREFIXES, RENT_FORGET_MS, RENT_HALF_LIFE_S, HomingLedger
from tests.routing.support import (
    MODEL,
    gateway_config,
    make_node,
    make_snapshot,
    publish,
    publish_live,
    running_gateway,
    wait_for,
)

NOW_S = 1_700_000_000.0
HOME, ABROAD = "eu-central", "us-east"
RTT_ABROAD_MS = 88.0
FAMILY_CHUNKS = 64  # 16,384 characters: ~4,100 tokens at 4 characters a token, ~410 ms of prefill


def text(seed: str, chunks: int) -> str:
    return "".join(f"{seed}-{index:06d}-".ljust(CHUNK_BYTES, "x") for index in range(chunks))


class Region:
    """One gateway's region (two home nodes, two abroad), its prefix index and its homing ledger."""

    def __init__(self, ratio: float, home_queue_tokens: int = 0) -> None:
        self.nodes = (
            make_node(1, region=HOME),
            make_node(2, region=HOME),
            make_node(3, region=ABROAD),
            make_node(4, region=ABROAD),
        )
        self.params = GorgoParams(homing_rent_ratio=ratio)
        self.index = ApproxPrefixIndex(chars_per_token=4.0)
        self.ledger = HomingLedger()
        self.home_queue_tokens = home_queue_tokens
        self.sequence = 0

    def decide(self, prompt: str) -> gorgo.Decision:
        hashes = self.index.chunk_hashes(prompt)
        ids = [node.id for node in self.nodes]
        self.sequence += 1
        queued = {1: NodeLoad(1, self.home_queue_tokens, 1), 2: NodeLoad(1, self.home_queue_tokens, 1)}
        view = RoutingView(
            region=HOME,
            candidates=self.nodes,
            params=self.params,
            load=queued if self.home_queue_tokens else {},
            rtt_ms={1: 1.5, 2: 1.5, 3: RTT_ABROAD_MS, 4: RTT_ABROAD_MS},
            matched_tokens=self.index.match_hashes(hashes, ids, NOW_S),
            sequence=self.sequence,
            gateway_id="gw-eu",
            prefix=PrefixRent(hashes, self.index.chunk_tokens, self.ledger.owed),
        )
        decision = gorgo.choose(view, RoutingRequest(MODEL, len(prompt), len(prompt) // 4))
        # What the gateway does after the decision (routing/proxy/handler.py's _route).
        if decision.rent_keys:
            if decision.homed:
                self.ledger.settle(decision.rent_keys)
            else:
                self.ledger.pay(decision.rent_keys, decision.rent_ms)
        self.index.insert_hashes(decision.node.id, hashes, NOW_S)
        return decision


def family_cached_abroad(region: Region) -> str:
    """The family's system prompt, sent once to node 3 (a cold start put it there)."""
    system = text("system", FAMILY_CHUNKS)
    region.index.insert_hashes(3, region.index.chunk_hashes(system + text("first", 2)), NOW_S)
    return system


def test_without_homing_a_family_cached_abroad_stays_abroad() -> None:
    """The trap, as gorgo routed before: every request of the family pays the round trip."""
    region = Region(ratio=0.0)
    system = family_cached_abroad(region)
    decisions = [region.decide(system + text(f"user{n}", 2)) for n in range(30)]
    assert {decision.node.region for decision in decisions} == {ABROAD}
    assert not any(decision.rent_keys for decision in decisions)


def test_with_homing_the_family_comes_home_once_its_rent_is_paid_up() -> None:
    region = Region(ratio=2.0)
    system = family_cached_abroad(region)
    decisions = [region.decide(system + text(f"user{n}", 2)) for n in range(30)]
    regions = [decision.node.region for decision in decisions]
    first_home = regions.index(HOME)
    homed = decisions[first_home]
    assert homed.homed and homed.rent_keys and homed.runner_up is not None
    assert homed.runner_up.node_id in (3, 4)  # the forward it skipped
    assert 1 <= first_home <= 10
    assert regions[first_home:] == [HOME] * (30 - first_home)  # the family follows the prefix home
    # Each forward before it paid what it would have saved at a home node holding the prefix (about
    # the round trip), all under one key: the prefix the node abroad holds.
    rents = decisions[:first_home]
    assert {decision.rent_keys for decision in rents} == {homed.rent_keys}
    assert all(RTT_ABROAD_MS * 0.8 < decision.rent_ms < RTT_ABROAD_MS * 1.2 for decision in rents)
    assert not set(homed.rent_keys) & set(region.ledger.owed)  # paid up


def test_the_rent_it_takes_grows_with_the_ratio() -> None:
    def forwards_before_home(ratio: float) -> int:
        region = Region(ratio=ratio)
        system = family_cached_abroad(region)
        regions = [region.decide(system + text(f"user{n}", 2)).node.region for n in range(60)]
        return regions.index(HOME)

    assert forwards_before_home(1.0) < forwards_before_home(2.0) < forwards_before_home(4.0)


def test_it_does_not_buy_onto_a_home_node_with_a_queue() -> None:
    """A long prefill queued behind others makes every later arrival there wait too: home must be
    idle. (Here the queue also makes home lose even with the prefix: no rent either.)"""
    region = Region(ratio=2.0, home_queue_tokens=8_000)
    system = family_cached_abroad(region)
    decisions = [region.decide(system + text(f"user{n}", 2)) for n in range(30)]
    assert {decision.node.region for decision in decisions} == {ABROAD}
    assert not any(decision.homed for decision in decisions)


def test_a_forward_the_cache_does_not_decide_pays_no_rent() -> None:
    """Unique prompts cached nowhere: nothing to bring home, no rent."""
    region = Region(ratio=2.0, home_queue_tokens=20_000)  # home is busy: overflow goes abroad
    decisions = [region.decide(text(f"unique{n}", 40)) for n in range(10)]
    assert any(decision.node.region == ABROAD for decision in decisions)
    assert not any(decision.rent_keys for decision in decisions)


def test_a_family_s_conversations_pay_its_rent_together() -> None:
    """Each conversation's later turns have their history abroad too, so each has a prefix of its
    own; their rent still adds up under the family's system prompt, and the family comes home."""
    region = Region(ratio=3.0)
    system = text("system", FAMILY_CHUNKS)
    # Twenty conversations of the family, each a few turns in, all held abroad (a cold start).
    conversations = [system + text(f"history{n}", 4) for n in range(20)]
    for history in conversations:
        region.index.insert_hashes(3, region.index.chunk_hashes(history + text("turn", 1)), NOW_S)
    decisions = [region.decide(history + text("next", 1)) for history in conversations]
    deepest = {decision.rent_keys[0] for decision in decisions if decision.rent_keys}
    assert len(deepest) > 1  # each conversation's own prefix
    assert any(decision.homed for decision in decisions)  # the family's rent added up


def test_a_shadow_reads_the_rent_but_the_live_side_alone_pays_it() -> None:
    """choose_twice (a shadow that reweighs the live policy) decides on the same view: both see the
    ledger, neither writes it (the gateway applies the live decision's rent only)."""
    region = Region(ratio=2.0)
    system = family_cached_abroad(region)
    prompt = system + text("user", 2)
    hashes = region.index.chunk_hashes(prompt)
    ids = [node.id for node in region.nodes]
    view = RoutingView(
        HOME,
        region.nodes,
        region.params,
        {},
        {1: 1.5, 2: 1.5, 3: RTT_ABROAD_MS, 4: RTT_ABROAD_MS},
        None,
        region.index.match_hashes(hashes, ids, NOW_S),
        1,
        "gw-eu",
        PrefixRent(hashes, region.index.chunk_tokens, region.ledger.owed),
    )
    request = RoutingRequest(MODEL, len(prompt), len(prompt) // 4)
    live, shadow = gorgo.choose_twice(view, request, GorgoParams(homing_rent_ratio=0.0))
    assert live.node.region == ABROAD and live.rent_keys and live.rent_ms > 0
    assert shadow.node.region == ABROAD and not shadow.rent_keys
    assert region.ledger.owed == {}


class TestLedger:
    def test_rent_halves_over_its_half_life_and_small_debts_go(self) -> None:
        ledger = HomingLedger()
        ledger.fade_to(0.0)
        ledger.pay((1,), 100.0)
        ledger.pay((2,), 1.5)
        ledger.fade_to(FADE_STEP_S / 2)  # within a step: nothing moves
        assert ledger.owed == {1: 100.0, 2: 1.5}
        ledger.fade_to(RENT_HALF_LIFE_S)
        assert ledger.owed[1] == pytest.approx(50.0)
        assert 2 not in ledger.owed  # 0.75 ms: below RENT_FORGET_MS
        assert RENT_FORGET_MS > 0.75

    def test_settling_clears_a_debt_and_paying_adds_up(self) -> None:
        ledger = HomingLedger()
        ledger.pay((7, 9), 40.0)
        ledger.pay((7,), 2.5)
        assert ledger.owed == {7: 42.5, 9: 40.0}
        ledger.settle((7, 8))  # 8 owes nothing: nothing to do
        assert ledger.owed == {9: 40.0}

    def test_it_keeps_the_larger_debts_when_full(self) -> None:
        ledger = HomingLedger()
        for key in range(MAX_PREFIXES + 1):
            ledger.pay((key,), float(key))
        assert len(ledger.owed) <= MAX_PREFIXES // 2 + 1
        assert MAX_PREFIXES in ledger.owed and 0 not in ledger.owed


async def test_the_gateway_brings_a_family_home_and_says_so(aredis, redis_keys, redis_url, stubs) -> None:
    """Through the gateway: forwards pay rent (record and metric), one request stays home (its record
    says ``homed``, its runner-up is the forward it skipped), the family's next requests stay home."""
    home = make_node(1, stubs[0].url, region=HOME)
    abroad = make_node(2, stubs[1].url, region=ABROAD)
    await publish(aredis, redis_keys, make_snapshot((home, abroad), params=GorgoParams()))
    await publish_live(aredis, redis_keys, rtt_ms={(HOME, 1): 1.5, (HOME, 2): 200.0})
    system = text("system", FAMILY_CHUNKS)

    def body(user: str) -> dict[str, object]:
        return {
            "model": MODEL,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": 4,
        }

    async with running_gateway(gateway_config(redis_keys, redis_url, region=HOME)) as gateway:
        await wait_for(lambda: gateway.app.runtime.store.table.rtt_ms.get(2) == 200.0)
        # A cold start put the family's prefix abroad (the gateway's index says node 2 holds it).
        gateway.app.index.insert(2, parse_body("chat", msgspec.json.encode(body("first"))).prompt_text)
        answers = [await gateway.http.post("/v1/chat/completions", json=body(f"user {n}")) for n in range(12)]
        metrics = (await gateway.http.get("/metrics")).text

        async def logged() -> bool:
            return await aredis.xlen(redis_keys.request_stream) >= 12

        await wait_for(logged)
    assert {answer.status_code for answer in answers} == {200}
    records = [
        decode(fields[b"r"], RequestRecord) for _, fields in await aredis.xrange(redis_keys.request_stream)
    ]
    served = [record.node_id for record in records]
    first_home = served.index(1)
    assert first_home >= 1 and served[first_home:] == [1] * (len(served) - first_home)
    assert all(record.rent_ms > 0 and not record.homed for record in records[:first_home])
    homed = records[first_home]
    assert homed.homed and homed.runner_up is not None and homed.runner_up.node_id == 2
    assert "gorgo_gateway_prefixes_homed_total 1.0" in metrics
    assert "gorgo_gateway_prefix_rent_seconds_total 0.0\n" not in metrics


def test_the_rent_keys_name_every_chunk_the_node_abroad_holds_at_a_learned_chars_per_token() -> None:
    """The index reports int(chunks x chunk_tokens); the keys took int(tokens / chunk_tokens),
    a chunk short whenever a chunk is not a whole number of tokens (chars/token 3.7: 69.19 tokens).
    A node holding exactly a 16-chunk system prompt was keyed at chunk 15 for the first turn and
    at 16 for the later ones, splitting the family's rent."""
    chars_per_token = 3.7
    for held_chunks in (16, 17, 33):
        index = ApproxPrefixIndex(chars_per_token=chars_per_token, clock=lambda: 1000.0)
        held = "".join(chr(97 + (i * 7 % 26)) for i in range(held_chunks * CHUNK_BYTES))
        index.insert(7, held)
        prompt = held + "another conversation of the family " * 40
        hashes = index.text_hashes(prompt)
        keys = PrefixRent(hashes, CHUNK_BYTES / chars_per_token, {}).keys(index.match((7,), prompt)[7])
        assert keys[0] == hashes[held_chunks - 1], held_chunks  # its deepest chunk
        assert hashes[15] in keys  # the family's 16-chunk key
