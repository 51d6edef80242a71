"""gorgo's cost model: the TTFT estimate, its terms, ties, the runner-up and the capacity guard."""

from __future__ import annotations

import msgspec
import pytest

from routing.algorithms import gorgo
from routing.algorithms.base import NodeLoad, RoutingRequest, RoutingView
from routing.contract import SCHEMA_VERSION, GorgoParams, NodeLiveState, NodeSpec
from tests.routing.support import MODEL, make_node


def node(node_id: int, *, region: str = "us-east", **changes: object) -> NodeSpec:
    return msgspec.structs.replace(make_node(node_id, region=region), **changes)


def request(prompt_tokens: int) -> RoutingRequest:
    return RoutingRequest(model=MODEL, prompt_chars=prompt_tokens * 4, prompt_tokens_est=prompt_tokens)


def view(nodes: tuple[NodeSpec, ...], params: GorgoParams | None = None, **fields: object) -> RoutingView:
    return RoutingView(region="us-east", candidates=nodes, params=params or GorgoParams(), **fields)  # type: ignore[arg-type]


def test_it_estimates_ttft_as_rtt_plus_queue_plus_uncached_prefill() -> None:
    one = node(1, prefill_tokens_per_s=10_000.0, max_num_seqs=256)
    decision = gorgo.choose(
        view(
            (one,),
            load={1: NodeLoad(outstanding_requests=0, outstanding_prefill_tokens=2_000)},
            rtt_ms={1: 50.0},
            matched_tokens={1: 1_000},
        ),
        request(3_000),
    )
    cost = decision.cost
    assert cost is not None
    assert (cost.rtt_ms, cost.queue_ms, cost.prefill_ms) == pytest.approx((50.0, 200.0, 200.0))
    assert cost.total_ms == pytest.approx(450.0)
    assert (cost.matched_tokens, cost.uncached_tokens) == (1_000, 2_000)
    assert decision.runner_up is None


def test_it_weights_the_terms_and_slows_prefill_on_a_busy_node() -> None:
    one = node(1, prefill_tokens_per_s=10_000.0, max_num_seqs=256)
    params = GorgoParams(w_rtt=2.0, w_queue=0.5)
    load = {1: NodeLoad(outstanding_requests=128, outstanding_prefill_tokens=2_000)}
    cost = gorgo.choose(view((one,), params, load=load, rtt_ms={1: 50.0}), request(2_000)).cost
    assert cost is not None
    # 128 of 256 slots running: s = 0.25 * 0.5 = 0.125 on the queue ahead and on the own prefill
    assert cost.queue_ms == pytest.approx((2_000 * 1.125 + 2_000 * 0.125) / 10.0)
    assert cost.total_ms == pytest.approx(2.0 * 50.0 + 0.5 * cost.queue_ms + 200.0)


def test_it_uses_the_default_rtt_for_unmeasured_nodes_and_the_scraped_batch_when_larger() -> None:
    one = node(1, max_num_seqs=100)
    live = NodeLiveState(
        schema_version=SCHEMA_VERSION, node_id=1, healthy=True, updated_at=0.0, num_running=40, num_waiting=10
    )
    cost = gorgo.choose(
        view((one,), GorgoParams(default_rtt_ms=123.0), load={1: NodeLoad(5, 1_000)}, live={1: live}),
        request(0),
    ).cost
    assert cost is not None
    assert cost.rtt_ms == 123.0
    assert cost.queue_ms == pytest.approx(1_000 * (1 + 0.25 * 50 / 100) / 10.0)


def test_it_trades_a_cache_hit_against_the_round_trip() -> None:
    local, remote = node(1), node(2, region="ap-south")
    rtt = {1: 1.5, 2: 235.0}
    # 8k tokens at 10k tokens/s: 800 ms of prefill saved outweighs 233 ms more round trip ...
    hit_far = gorgo.choose(view((local, remote), rtt_ms=rtt, matched_tokens={2: 8_000}), request(8_200))
    assert hit_far.node.id == 2
    # ... but 1k tokens (100 ms) does not.
    small_hit_far = gorgo.choose(view((local, remote), rtt_ms=rtt, matched_tokens={2: 1_000}), request(1_200))
    assert small_hit_far.node.id == 1
    assert small_hit_far.runner_up is not None and small_hit_far.runner_up.node_id == 2


def test_it_sends_ties_and_near_ties_to_the_lower_load() -> None:
    nodes = (node(1), node(2))
    load = {1: NodeLoad(3, 0), 2: NodeLoad(1, 0)}
    assert gorgo.choose(view(nodes, rtt_ms={1: 10.0, 2: 10.0}, load=load), request(500)).node.id == 2
    # 0.4 ms apart on a ~60 ms estimate is noise, not a reason to load the busier node.
    assert gorgo.choose(view(nodes, rtt_ms={1: 10.0, 2: 10.4}, load=load), request(500)).node.id == 2
    # A clear difference is not a tie.
    assert gorgo.choose(view(nodes, rtt_ms={1: 10.0, 2: 30.0}, load=load), request(500)).node.id == 1


def test_it_skips_full_nodes_while_another_has_room() -> None:
    cached = node(1, max_num_seqs=8)
    other = node(2, max_num_seqs=8)
    fields = dict(rtt_ms={1: 1.0, 2: 1.0}, matched_tokens={1: 8_000})
    room = {1: NodeLoad(7, 0), 2: NodeLoad(2, 0)}
    assert gorgo.choose(view((cached, other), load=room, **fields), request(8_000)).node.id == 1
    full = {1: NodeLoad(8, 0), 2: NodeLoad(2, 0)}
    assert gorgo.choose(view((cached, other), load=full, **fields), request(8_000)).node.id == 2
    unguarded = gorgo.Guards(capacity=False)
    assert (
        gorgo.choose_guarded(view((cached, other), load=full, **fields), request(8_000), unguarded).node.id
        == 1
    )
    # Everyone full: still route (to the cheapest) rather than refuse.
    all_full = {1: NodeLoad(8, 0), 2: NodeLoad(8, 0)}
    assert gorgo.choose(view((cached, other), load=all_full, **fields), request(8_000)).node.id == 1


def test_displacement_is_charged_only_abroad_and_greedy_leaves_it_out() -> None:
    home = node(1, prefill_tokens_per_s=10_000.0)
    abroad = node(2, region="eu-central", prefill_tokens_per_s=10_000.0)
    # Five requests on each node; abroad they are eu-central's own clients', at home imports.
    load = {1: NodeLoad(5, 1_000), 2: NodeLoad(5, 1_000, home_requests=5)}
    rtt = {1: 1.0, 2: 1.0}
    assert GorgoParams().w_displacement == 1.0
    greedy = gorgo.choose(
        view((home, abroad), GorgoParams(w_displacement=0.0), load=load, rtt_ms=rtt), request(2_000)
    )
    assert greedy.cost is not None and greedy.runner_up is not None
    assert greedy.cost.displacement_ms == greedy.runner_up.displacement_ms == 0.0

    priced = gorgo.choose(view((home, abroad), load=load, rtt_ms=rtt), request(2_000))
    assert priced.node.id == 1 and priced.cost is not None and priced.runner_up is not None
    assert priced.cost.displacement_ms == 0.0
    # abroad: 5 of eu-central's requests there / (1,000 ms decoding + 100 queue + 200 prefill) of
    # residence * (100 + 200) ms there * min(200, 100 + 100); staying displaces no one of us-east's
    assert priced.runner_up.displacement_ms == pytest.approx(5 / 1300 * 300 * 200, rel=0.01)


def test_displacement_counts_the_receiving_regions_own_requests_over_their_real_residence() -> None:
    # Little's law: 10 of eu-central's requests queued ~1 s deep there arrived over their whole
    # stay (1 s decoding + the queue + prefill), not over 1 s; requests other regions forwarded
    # there are not eu-central's arrivals. Counting both (the old rule) priced a forward by the
    # square of the receiving queue.
    home = node(1, prefill_tokens_per_s=10_000.0)
    abroad = node(2, region="eu-central", prefill_tokens_per_s=10_000.0)
    fields = {"rtt_ms": {1: 1.0, 2: 100.0}}
    imports_only = {1: NodeLoad(3, 3_000), 2: NodeLoad(10, 10_000, home_requests=0)}
    cost = gorgo.choose(view((home, abroad), load=imports_only, **fields), request(2_000)).runner_up
    assert cost is not None and cost.node_id == 2 and cost.displacement_ms == 0.0

    its_own = {1: NodeLoad(3, 3_000), 2: NodeLoad(10, 10_000, home_requests=10)}
    cost = gorgo.choose(view((home, abroad), load=its_own, **fields), request(2_000)).runner_up
    assert cost is not None and cost.node_id == 2
    queue_ms, prefill_ms = 1_000.0, 200.0
    expected = 10 / (gorgo.RESIDENCE_MS + queue_ms + prefill_ms) * (queue_ms + prefill_ms) * prefill_ms
    assert cost.displacement_ms == pytest.approx(expected, rel=0.01)


def test_a_forward_is_priced_only_beyond_what_staying_displaces_at_home() -> None:
    # An overloaded home (30 of its own requests, 2.8 s of queue): the request displaces its own
    # region's later arrivals if it stays, more than it would displace eu-central's by leaving.
    # Priced as if staying were free (the old rule), the overflow stayed home and made the
    # diurnal workload's p99; net of staying, the forward wins.
    home = node(1, prefill_tokens_per_s=10_000.0)
    abroad = node(2, region="eu-central", prefill_tokens_per_s=10_000.0)
    load = {1: NodeLoad(30, 28_000, home_requests=30), 2: NodeLoad(10, 10_000, home_requests=10)}
    rtt = {1: 1.0, 2: 100.0}
    decision = gorgo.choose(view((home, abroad), load=load, rtt_ms=rtt), request(2_000))
    assert decision.node.id == 2 and decision.cost is not None
    assert decision.cost.displacement_ms == 0.0

    # A light home displaces little by staying: the same forward pays what it displaces beyond that.
    light = {1: NodeLoad(2, 2_000, home_requests=2), 2: NodeLoad(10, 10_000, home_requests=10)}
    decision = gorgo.choose(view((home, abroad), load=light, rtt_ms=rtt), request(2_000))
    assert decision.node.id == 1 and decision.runner_up is not None
    staying = 2 / (gorgo.RESIDENCE_MS + 200.0 + 200.0) * 400.0 * 200.0
    abroad_factor = 10 / (gorgo.RESIDENCE_MS + 1_000.0 + 200.0) * 1_200.0 * 200.0
    assert decision.runner_up.displacement_ms == pytest.approx(abroad_factor - staying, rel=0.02)


def test_displacement_sends_overflow_to_an_idle_region_before_a_busy_neighbour() -> None:
    home = node(1, prefill_tokens_per_s=10_000.0)
    neighbour = node(2, region="eu-central", prefill_tokens_per_s=10_000.0)
    far = node(3, region="ap-south", prefill_tokens_per_s=10_000.0)
    # The neighbour's 30 requests are its own clients'; home's 40 are imports (its own are elsewhere).
    load = {1: NodeLoad(40, 20_000), 2: NodeLoad(30, 500, home_requests=30), 3: NodeLoad(0, 0)}
    rtt = {1: 1.0, 2: 90.0, 3: 200.0}
    greedy = gorgo.choose(
        view((home, neighbour, far), GorgoParams(w_displacement=0.0), load=load, rtt_ms=rtt), request(2_000)
    )
    assert greedy.node.id == 2  # the nearest neighbour, whose own clients then wait behind it
    priced = gorgo.choose(view((home, neighbour, far), load=load, rtt_ms=rtt), request(2_000))
    assert priced.node.id == 3


def test_a_node_whose_kv_cache_is_held_by_long_decodes_queues_a_prompt_that_does_not_fit() -> None:
    # Node 1 has no prefill queued but its 32k-token cache is held by requests still decoding
    # (long answers): a 4k-token prompt waits for them to free blocks. Without the term it looked
    # idle and took every request (mixed-length: p50 of seconds on the wall clock).
    full = node(1, prefill_tokens_per_s=10_000.0, kv_capacity_tokens=32_768)
    room = node(2, prefill_tokens_per_s=10_000.0, kv_capacity_tokens=32_768)
    load = {
        1: NodeLoad(12, 0, outstanding_context_tokens=32_000),
        2: NodeLoad(14, 500, outstanding_context_tokens=20_000),
    }
    decision = gorgo.choose(view((full, room), load=load, rtt_ms={1: 1.0, 2: 1.0}), request(4_000))
    assert decision.node.id == 2 and decision.runner_up is not None
    excess = 32_000 + 4_000 - 32_768
    own_slowdown_ms = 4_000 * gorgo.DECODE_SLOWDOWN_AT_FULL_BATCH * 12 / 256 / 10.0
    kv_wait_ms = excess * gorgo.RESIDENCE_MS / 32_000
    assert decision.runner_up.queue_ms == pytest.approx(own_slowdown_ms + kv_wait_ms)
