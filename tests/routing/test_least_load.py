"""least_load: fewest outstanding requests, then fewest prefill tokens; ties rotate."""

from __future__ import annotations

from collections import Counter

from routing.algorithms import REGISTRY
from routing.algorithms.base import NodeLoad, RoutingRequest, RoutingView
from routing.algorithms.least_load import choose
from routing.contract import LeastLoadParams
from tests.routing.support import MODEL, make_node

REQUEST = RoutingRequest(model=MODEL, prompt_chars=100, prompt_tokens_est=25)
NODES = (make_node(1), make_node(2), make_node(3))


def view(load: dict[int, NodeLoad], sequence: int = 0) -> RoutingView:
    return RoutingView(
        region="us-east", candidates=NODES, params=LeastLoadParams(), load=load, sequence=sequence
    )


class TestLeastLoad:
    def test_it_is_registered(self):
        assert REGISTRY["least_load"].choose is choose

    def test_it_picks_the_node_with_fewest_outstanding_requests(self):
        load = {1: NodeLoad(5, 0), 2: NodeLoad(1, 9000), 3: NodeLoad(3, 0)}
        for sequence in range(3):  # whatever the rotation offset
            assert choose(view(load, sequence), REQUEST).node.id == 2

    def test_it_breaks_request_ties_on_prefill_tokens(self):
        load = {1: NodeLoad(2, 800), 2: NodeLoad(2, 100), 3: NodeLoad(2, 400)}
        for sequence in range(3):
            assert choose(view(load, sequence), REQUEST).node.id == 2

    def test_it_treats_unknown_nodes_as_idle(self):
        load = {1: NodeLoad(1, 0), 2: NodeLoad(1, 0)}
        assert choose(view(load), REQUEST).node.id == 3

    def test_it_rotates_among_equally_idle_nodes(self):
        counts = Counter(choose(view({}, sequence), REQUEST).node.id for sequence in range(30))
        assert counts == {1: 10, 2: 10, 3: 10}
