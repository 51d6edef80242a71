"""A gorgo shadow that only moves the weights decides exactly as a second ``choose`` would (issue 23)."""

from __future__ import annotations

import random

from routing.algorithms import gorgo
from routing.algorithms.base import NodeLoad, RoutingRequest, RoutingView
from routing.contract import GorgoParams
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
