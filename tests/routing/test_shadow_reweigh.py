"""A gorgo shadow that only moves the weights decides exactly as a second ``choose`` would (issue 23)."""

from __future__ import annotations

import random

import pytest

from routing.algorithms import gorgo
from routing.algorithms.base import NodeLoad, RoutingRequest, RoutingView
from routing.contract import CostTerms, GorgoParams, NodeLiveState
from tests.routing.support import MODEL, make_node

REGIONS = ("us-east", "eu-central", "ap-south")


def test_weighing_the_terms_twice_is_choosing_twice() -> None:
    rng = random.Random(23)
    for case in range(300):
        nodes = tuple(
            make_node(i + 1, region=REGIONS[i % 3], max_num_seqs=rng.choice((4, 64)))
            for i in range(rng.randint(1, 12))
        )
        live = GorgoParams(
            w_rtt=rng.uniform(0, 3), w_queue=rng.uniform(0, 3), w_displacement=rng.choice((0.0, 1.0))
        )
        shadow = GorgoParams(
            w_rtt=rng.uniform(0, 3), w_queue=rng.uniform(0, 3), w_displacement=rng.choice((0.0, 2.0))
        )
        load = {n.id: NodeLoad(rng.randint(0, 8), rng.randint(0, 30_000)) for n in nodes}
        rtt = {n.id: rng.uniform(1, 250) for n in nodes if rng.random() < 0.8}
        matched = {n.id: rng.choice((0, 0, 256, 1024)) for n in nodes}
        request = RoutingRequest(MODEL, 6_000, 1_500)
        view = RoutingView("us-east", nodes, live, load, rtt, {}, matched, case, "gw")
        twice = gorgo.choose_twice(view, request, shadow)
        shadow_view = RoutingView("us-east", nodes, shadow, load, rtt, {}, matched, case, "gw")
        assert twice == (gorgo.choose(view, request), gorgo.choose(shadow_view, request)), case


def test_another_default_rtt_changes_only_the_unmeasured_nodes_rtt() -> None:
    rng = random.Random(25)
    for case in range(300):
        nodes = tuple(
            make_node(i + 1, region=REGIONS[i % 3], max_num_seqs=rng.choice((4, 64)))
            for i in range(rng.randint(1, 12))
        )
        live = GorgoParams(w_rtt=rng.uniform(0, 3), default_rtt_ms=rng.choice((100.0, 20.0)))
        shadow = GorgoParams(
            w_rtt=rng.uniform(0, 3), w_queue=rng.uniform(0, 3), default_rtt_ms=rng.choice((50.0, 300.0))
        )
        load = {n.id: NodeLoad(rng.randint(0, 8), rng.randint(0, 30_000)) for n in nodes}
        rtt = {n.id: rng.uniform(1, 250) for n in nodes if rng.random() < 0.5}
        matched = {n.id: rng.choice((0, 0, 256, 1024)) for n in nodes}
        request = RoutingRequest(MODEL, 6_000, 1_500)
        view = RoutingView("us-east", nodes, live, load, rtt, {}, matched, case, "gw")
        twice = gorgo.choose_twice(view, request, shadow)
        shadow_view = RoutingView("us-east", nodes, shadow, load, rtt, {}, matched, case, "gw")
        assert twice == (gorgo.choose(view, request), gorgo.choose(shadow_view, request)), case


def _random_fleet(rng: random.Random, case: int, params: GorgoParams) -> tuple[RoutingView, RoutingRequest]:
    """Views where every term and guard shows up: home requests (displacement), hot nodes, KV
    pressure, scraped live load, unmeasured RTTs."""
    nodes = tuple(
        make_node(
            i + 1,
            region=REGIONS[i % 3],
            max_num_seqs=rng.choice((4, 64)),
            kv_capacity_tokens=rng.choice((4_000, 500_000)),
        )
        for i in range(rng.randint(1, 12))
    )
    load = {
        n.id: NodeLoad(
            rng.randint(0, 30), rng.randint(0, 30_000), rng.randint(0, 10), rng.choice((0, 3_000, 50_000))
        )
        for n in nodes
    }
    rtt = {n.id: rng.uniform(1, 250) for n in nodes if rng.random() < 0.8}
    live = {
        n.id: NodeLiveState(1, n.id, True, 0.0, num_running=float(rng.randint(0, 80)), num_waiting=1.0)
        for n in nodes
        if rng.random() < 0.5
    }
    matched = {n.id: rng.choice((0, 0, 256, 1024)) for n in nodes}
    view = RoutingView(rng.choice(REGIONS), nodes, params, load, rtt, live, matched, case, "gw")
    return view, RoutingRequest(MODEL, 6_000, 1_500)


def _same_terms(got: CostTerms, want: CostTerms) -> bool:
    """Equal, the totals up to rounding (the terms are summed in another order)."""
    return (
        (got.node_id, got.rtt_ms, got.queue_ms, got.prefill_ms, got.matched_tokens, got.uncached_tokens)
        == (
            want.node_id,
            want.rtt_ms,
            want.queue_ms,
            want.prefill_ms,
            want.matched_tokens,
            want.uncached_tokens,
        )
        and got.total_ms == pytest.approx(want.total_ms, rel=1e-9, abs=1e-9)
        and got.displacement_ms == pytest.approx(want.displacement_ms, rel=1e-9, abs=1e-9)
    )


def test_choosing_and_pricing_a_node_is_what_choose_says_of_that_node() -> None:
    """``choose_and_price``'s decision is ``choose_with``'s, and its terms for a node are the ones
    ``choose`` under the pricing parameters gives that node when it wins or runs up."""
    rng = random.Random(27)
    checked = 0
    for case in range(400):
        shadow = GorgoParams(
            w_rtt=rng.uniform(0, 3),
            w_queue=rng.uniform(0, 3),
            w_displacement=rng.choice((0.0, 2.0)),
            default_rtt_ms=rng.choice((100.0, 50.0)),
        )
        pricing = rng.choice((GorgoParams(), GorgoParams(w_displacement=0.0, default_rtt_ms=300.0)))
        view, request = _random_fleet(rng, case, shadow)
        priced_view = RoutingView(
            view.region, view.candidates, pricing, view.load, view.rtt_ms, view.live,
            view.matched_tokens, view.sequence, view.gateway_id,
        )  # fmt: skip
        by_pricing = gorgo.choose(priced_view, request)
        for node in view.candidates:
            decision, terms = gorgo.choose_and_price(view, request, shadow, node, pricing)
            assert decision == gorgo.choose_with(view, request, shadow, runner_up=False), case
            assert terms is not None
            for want in (by_pricing.cost, by_pricing.runner_up):
                if want is not None and want.node_id == node.id:
                    assert _same_terms(terms, want), (case, terms, want)
                    checked += 1
        outsider = make_node(99, region="us-east")
        assert gorgo.choose_and_price(view, request, shadow, outsider, pricing)[1] is None
    assert checked > 600


def test_a_request_both_sides_send_to_one_node_gets_one_prediction() -> None:
    """A live policy that prices nothing (round robin here) is priced by gorgo's model: where the
    gorgo shadow picks the same node, both sides' terms are the same (before, the live side was
    priced as that node's lone candidate: full cache credit on a hot node, the whole displacement
    of a forward)."""
    from routing.algorithms import round_robin
    from routing.contract import PolicySpec, RoundRobinParams, TrialSpec
    from routing.proxy.shadow import shadow_decision
    from routing.state.trials import TrialRoute

    rng = random.Random(29)
    same = differed_before = 0
    for case in range(600):
        view, request = _random_fleet(rng, case, RoundRobinParams())
        spec = TrialSpec(
            id=1, kind="shadow", policy=PolicySpec(id=2, name="s", algorithm="gorgo", params=GorgoParams())
        )
        shadow = TrialRoute(spec, gorgo.INFO, GorgoParams(), {MODEL: view.candidates}, 0, b"", True)
        live = round_robin.choose(view, request)
        outcome = shadow_decision(shadow, view, request, live)
        if outcome.node is live.node:
            same += 1
            # One object: the request record logs it once (RequestRecord.shadow_terms).
            assert outcome.live_cost is not None and outcome.live_cost is outcome.cost, case
            lone = gorgo.price(view, request, live.node, GorgoParams())
            differed_before += not _same_terms(lone, outcome.cost)
    assert same > 100
    assert differed_before > 5  # the cases the old pricing got wrong are in the sample


def test_a_shadow_on_other_candidates_decides_on_the_live_requests_measured_speeds() -> None:
    """A shadow whose guards leave it other candidates than the live policy's gets a view of its
    own: it keeps the live view's measured prefill speeds (before, it was priced at the told speeds
    while the live side used the measured ones, so the two sides' TTFT estimates disagreed on the
    same node)."""
    from routing.contract import PolicySpec, TrialSpec
    from routing.proxy.shadow import shadow_decision
    from routing.state.trials import TrialRoute

    nodes = tuple(make_node(i, region=REGIONS[(i - 1) % 3], prefill_tokens_per_s=10_000.0) for i in (1, 2, 3))
    measured = {1: 0.5, 2: 0.5, 3: 0.5}  # ms per token: five times slower than the told 0.1
    request = RoutingRequest(MODEL, 8_000, 2_000)
    view = RoutingView(
        "us-east", nodes, GorgoParams(), {}, {1: 1.0, 2: 90.0, 3: 230.0}, {}, {}, 1, "gw", None, measured
    )
    live = gorgo.choose(view, request)
    spec = TrialSpec(
        id=1,
        kind="shadow",
        policy=PolicySpec(id=2, name="s", algorithm="gorgo", params=GorgoParams(w_rtt=2.0)),
    )
    home_only = {MODEL: nodes[:1]}  # e.g. a residency guard: the shadow may use us-east only
    shadow = TrialRoute(spec, gorgo.INFO, GorgoParams(w_rtt=2.0), home_only, 0, b"", False)
    outcome = shadow_decision(shadow, view, request, live)
    assert outcome.node is nodes[0] and outcome.cost is not None
    assert outcome.cost.prefill_ms == pytest.approx(2_000 * 0.5)  # measured, as the live side's
    assert live.cost is not None and live.cost.prefill_ms == pytest.approx(2_000 * 0.5)
