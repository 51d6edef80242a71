"""round_robin: rotate over the candidates in stable order."""

from __future__ import annotations

from collections import Counter

from routing.algorithms import REGISTRY
from routing.algorithms.base import RoutingRequest, RoutingView
from routing.algorithms.round_robin import choose
from routing.contract import RoundRobinParams
from tests.routing.support import MODEL, make_node

REQUEST = RoutingRequest(model=MODEL, prompt_chars=100, prompt_tokens_est=25)
NODES = (make_node(1), make_node(2), make_node(3))


def view(sequence: int, candidates=NODES) -> RoutingView:
    return RoutingView(region="us-east", candidates=candidates, params=RoundRobinParams(), sequence=sequence)


class TestRoundRobin:
    def test_it_is_registered(self):
        assert REGISTRY["round_robin"].choose is choose
        assert not REGISTRY["round_robin"].needs_prefix_matches

    def test_it_rotates_through_every_candidate(self):
        chosen = [choose(view(sequence), REQUEST).node.id for sequence in range(1, 7)]
        assert chosen == [2, 3, 1, 2, 3, 1]

    def test_it_spreads_evenly(self):
        counts = Counter(choose(view(sequence), REQUEST).node.id for sequence in range(300))
        assert counts == {1: 100, 2: 100, 3: 100}

    def test_it_works_with_a_single_candidate(self):
        assert choose(view(41, (make_node(7),)), REQUEST).node.id == 7
