"""gorgo's guards against the known failure modes of cache-aware routers.

Each test replays a sequence of decisions with load accumulating in the view (requests stay
outstanding, as long decodes do) and shows the failure with the guard switched off.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import msgspec

from routing.algorithms import gorgo
from routing.algorithms.base import NodeLoad, RoutingRequest, RoutingView
from routing.cache.approx_index import CHUNK_BYTES, ApproxPrefixIndex
from routing.contract import GorgoParams, NodeSpec
from tests.routing.support import MODEL, make_node

NOW_S = 1_700_000_000.0
SYSTEM_CHUNKS = 120  # 30,720 characters: a 7,680-token shared prefix at 4 characters per token


def text(seed: str, chunks: int) -> str:
    return "".join(f"{seed}-{index:06d}-".ljust(CHUNK_BYTES, "x") for index in range(chunks))


@dataclass
class Fleet:
    """Nodes in one region, a prefix index, and the outstanding work the decisions pile up."""

    nodes: tuple[NodeSpec, ...]
    index: ApproxPrefixIndex = field(default_factory=lambda: ApproxPrefixIndex(chars_per_token=4.0))
    requests: Counter[int] = field(default_factory=Counter)
    prefill_tokens: Counter[int] = field(default_factory=Counter)
    sequence: int = 0

    @classmethod
    def of(cls, count: int, max_num_seqs: int = 4096) -> Fleet:
        return cls(
            tuple(
                msgspec.structs.replace(make_node(i), max_num_seqs=max_num_seqs) for i in range(1, count + 1)
            )
        )

    def decide(
        self, prompt: str, guards: gorgo.Guards = gorgo.ALL_GUARDS, gateway_id: str = "gw"
    ) -> tuple[gorgo.Decision, float]:
        """Route one prompt, record it in the index and its load; return the decision and the
        predicted cached fraction."""
        hashes = self.index.chunk_hashes(prompt)
        ids = [node.id for node in self.nodes]
        self.sequence += 1
        view = RoutingView(
            region="us-east",
            candidates=self.nodes,
            params=GorgoParams(),
            load={i: NodeLoad(self.requests[i], self.prefill_tokens[i]) for i in ids},
            rtt_ms=dict.fromkeys(ids, 1.5),
            matched_tokens=self.index.match_hashes(hashes, ids, NOW_S),
            sequence=self.sequence,
            gateway_id=gateway_id,
        )
        request = RoutingRequest(MODEL, len(prompt), len(prompt) // 4)
        decision = gorgo.choose_guarded(view, request, guards)
        self.index.insert_hashes(decision.node.id, hashes, NOW_S)
        self.requests[decision.node.id] += 1
        assert decision.cost is not None
        return decision, decision.cost.matched_tokens / request.prompt_tokens_est


def test_it_spills_a_hot_prefix_instead_of_pinning_one_node() -> None:
    """production-stack #957: a long shared prefix routed all traffic to the node that held it."""

    def replay(guards: gorgo.Guards) -> Counter[int]:
        fleet = Fleet.of(4)
        system = text("system", SYSTEM_CHUNKS)
        fleet.index.insert_hashes(1, fleet.index.chunk_hashes(system), NOW_S)
        chosen: Counter[int] = Counter()
        for user in range(200):
            decision, _ = fleet.decide(system + text(f"user-{user}", 3), guards)
            chosen[decision.node.id] += 1
        return chosen

    guarded = replay(gorgo.ALL_GUARDS)
    assert guarded[1] <= 0.4 * 200
    assert len(+guarded) >= 3  # the prefix got cached on (and served by) other nodes

    pinned = replay(gorgo.Guards(hot_prefix=False))
    assert pinned[1] == 200


def test_it_stops_filling_a_node_at_its_batch_capacity() -> None:
    def replay(guards: gorgo.Guards) -> Counter[int]:
        fleet = Fleet.of(4, max_num_seqs=16)
        system = text("system", SYSTEM_CHUNKS)
        fleet.index.insert_hashes(1, fleet.index.chunk_hashes(system), NOW_S)
        for user in range(64):
            fleet.decide(system + text(f"user-{user}", 3), guards)
        return fleet.requests

    capped = replay(gorgo.Guards(hot_prefix=False))
    assert max(capped.values()) <= 16
    uncapped = replay(gorgo.Guards(hot_prefix=False, capacity=False))
    assert uncapped[1] == 64


def test_it_stops_sending_predicted_hits_to_a_node_whose_cache_misses() -> None:
    """SGLang's "death spiral": misses piling onto a node that cannot keep up.

    Node 1 thrashes (it reports no cached tokens, whatever the index predicted), so every request
    sent there for its "cache" is a full prefill the queue term never saw. Trust feedback
    (``ApproxPrefixIndex.observe``) withdraws the credit after a few such misses.
    """

    def replay(feedback: bool) -> int:
        fleet = Fleet.of(4, max_num_seqs=256)
        document = text("document", SYSTEM_CHUNKS)
        fleet.index.insert_hashes(1, fleet.index.chunk_hashes(document), NOW_S)
        misses = 0
        for question in range(200):
            decision, predicted = fleet.decide(document + text(f"question-{question}", 3))
            thrashing = decision.node.id == 1
            if thrashing and predicted > 0:
                misses += 1
            if feedback:
                fleet.index.observe(decision.node.id, predicted, 0.0 if thrashing else predicted, NOW_S)
        return misses

    assert replay(feedback=True) <= 10
    assert replay(feedback=False) >= 50


def test_it_spreads_a_burst_of_misses_by_queue_not_onto_one_node() -> None:
    """Misses are placed by RTT and queue (never by cache size), and each one's uncached tokens are
    charged to its node, so a burst of cold prompts spreads and avoids the already busy node."""
    fleet = Fleet.of(4, max_num_seqs=256)
    fleet.prefill_tokens[1] = 50_000  # 5 s of prefill already queued on node 1
    for burst in range(40):
        decision, _ = fleet.decide(text(f"cold-{burst}", 32))
        assert decision.cost is not None
        fleet.prefill_tokens[decision.node.id] += decision.cost.uncached_tokens
    assert fleet.requests[1] == 0
    spread = [fleet.requests[node_id] for node_id in (2, 3, 4)]
    assert max(spread) - min(spread) <= 1


def test_it_keeps_gateways_sharing_a_stale_view_from_herding() -> None:
    """Dynamo #589: router replicas that all pick "the best" node from the same view herd onto it.

    Three gateways each route two requests per load-sharing period; between refreshes each sees
    the others' load as of the last refresh plus its own new requests. Requests last four periods.
    """
    gateways = ("us-east-gw-1", "eu-central-gw-1", "ap-south-gw-1")

    def mean_imbalance(guards: gorgo.Guards) -> float:
        nodes = tuple(make_node(i) for i in range(1, 7))
        rtt_ms = {node.id: 1.0 + 0.05 * node.id for node in nodes}  # near-equal, as measured RTTs are
        sequence = Counter[str]()
        running: list[tuple[int, int]] = []  # (period it ends, node id)
        imbalance = 0
        for period in range(200):
            running = [(end, node_id) for end, node_id in running if end > period]
            shared = Counter(node_id for _, node_id in running)  # the last refresh, seen by all
            own = {gateway: Counter[int]() for gateway in gateways}
            for _ in range(2):
                for gateway in gateways:
                    seen = shared + own[gateway]
                    sequence[gateway] += 1
                    view = RoutingView(
                        region="us-east",
                        candidates=nodes,
                        params=GorgoParams(),
                        load={n.id: NodeLoad(seen[n.id], 0) for n in nodes},
                        rtt_ms=rtt_ms,
                        sequence=sequence[gateway],
                        gateway_id=gateway,
                    )
                    node_id = gorgo.choose_guarded(view, RoutingRequest(MODEL, 2_000, 500), guards).node.id
                    running.append((period + 4, node_id))
                    own[gateway][node_id] += 1
            now = shared + sum(own.values(), Counter[int]())
            imbalance += max(now[n.id] for n in nodes) - min(now[n.id] for n in nodes)
        return imbalance / 200

    guarded = mean_imbalance(gorgo.ALL_GUARDS)
    herded = mean_imbalance(gorgo.Guards(spread_ties=False))
    assert guarded < 0.6 * herded


def region_view(loads: dict[int, NodeLoad], region: str, matched: dict[int, int]) -> RoutingView:
    """Five nodes: a short region (one node), a neighbour (two) and a far region (two)."""
    nodes = (
        make_node(1, region="ap-northeast"),
        make_node(2, region="us-west"),
        make_node(3, region="us-west"),
        make_node(4, region="eu-west"),
        make_node(5, region="eu-west"),
    )
    rtt_from = {
        "ap-northeast": {"ap-northeast": 1.5, "us-west": 100.0, "eu-west": 210.0},
        "us-west": {"ap-northeast": 100.0, "us-west": 1.5, "eu-west": 130.0},
    }[region]
    return RoutingView(
        region=region,
        candidates=nodes,
        params=GorgoParams(),
        load=loads,
        rtt_ms={n.id: rtt_from[n.region] for n in nodes},
        matched_tokens=matched,
    )


def test_a_busy_region_is_not_a_hot_prefix_its_clients_keep_their_cache_at_home() -> None:
    """Issue 13: on a four-region fleet the short region's overflow filled its neighbour's nodes;
    the hot-prefix guard, comparing them with the idle far regions, then took their cache credit
    away, and the neighbour's own clients left home (35 % to the overloaded region)."""
    loads = {
        1: NodeLoad(6, 1_000),
        2: NodeLoad(20, 2_000),  # the neighbour: its own clients plus the overflow
        3: NodeLoad(20, 2_000),
        4: NodeLoad(0, 0),
        5: NodeLoad(0, 0),
    }
    request = RoutingRequest(MODEL, 20_000, 5_000)
    decision = gorgo.choose(region_view(loads, "us-west", {2: 5_000}), request)
    assert decision.node.id == 2  # its conversation's node at home, cache credited
    assert decision.cost is not None and decision.cost.matched_tokens == 5_000


def test_a_regions_only_node_keeps_its_cache_credit_however_busy() -> None:
    loads = {1: NodeLoad(30, 2_000), **{i: NodeLoad(2, 0) for i in range(2, 6)}}
    request = RoutingRequest(MODEL, 32_000, 8_000)
    decision = gorgo.choose(region_view(loads, "ap-northeast", {1: 8_000}), request)
    assert decision.node.id == 1
    assert decision.cost is not None and decision.cost.matched_tokens == 8_000
