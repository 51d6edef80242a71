"""prefix_affinity: SGLang's cache-aware policy (balance thresholds, then the cache threshold)."""

from __future__ import annotations

from routing.algorithms import prefix_affinity
from routing.algorithms.base import NodeLoad, RoutingRequest, RoutingView
from routing.contract import PrefixAffinityParams
from tests.routing.support import MODEL, make_node

NODES = (make_node(1), make_node(2), make_node(3))


def choose(load: dict[int, int], matched: dict[int, int], prompt_tokens: int = 1_000, **params: float) -> int:
    view = RoutingView(
        region="us-east",
        candidates=NODES,
        params=PrefixAffinityParams(**params),  # type: ignore[arg-type]
        load={node_id: NodeLoad(count, 0) for node_id, count in load.items()},
        matched_tokens=matched,
    )
    return prefix_affinity.choose(view, RoutingRequest(MODEL, prompt_tokens * 4, prompt_tokens)).node.id


def test_it_has_sglangs_defaults() -> None:
    params = PrefixAffinityParams()
    assert (params.cache_threshold, params.balance_abs_threshold, params.balance_rel_threshold) == (
        0.3,
        64,
        1.5,
    )


def test_it_follows_the_longest_match_above_the_cache_threshold() -> None:
    assert choose({1: 0, 2: 5, 3: 9}, {2: 310, 3: 900}) == 3
    assert choose({1: 0, 2: 5, 3: 9}, {2: 310}) == 2  # 31% > 30%


def test_it_sends_a_miss_to_the_least_loaded_node() -> None:
    assert choose({1: 7, 2: 5, 3: 9}, {3: 300}) == 2  # 30% is not above 30%
    assert choose({1: 7, 2: 5, 3: 9}, {}) == 2


def test_it_balances_load_when_both_thresholds_say_imbalanced() -> None:
    # 100 - 20 > 64 and 100 > 1.5 * 20: imbalanced, the cache does not matter.
    assert choose({1: 100, 2: 20, 3: 50}, {1: 1_000}) == 2
    # 100 - 40 is not above 64: balanced enough, the cache wins.
    assert choose({1: 100, 2: 40, 3: 50}, {1: 1_000}) == 1
    # 200 - 150 > 64 but 200 is not above 1.5 * 150: balanced enough.
    assert choose({1: 220, 2: 150, 3: 200}, {1: 1_000}) == 1
    # Thresholds are parameters.
    assert choose({1: 100, 2: 40, 3: 50}, {1: 1_000}, balance_abs_threshold=32) == 2


def test_it_logs_what_it_believed_was_cached() -> None:
    view = RoutingView(
        region="us-east", candidates=NODES, params=PrefixAffinityParams(), matched_tokens={2: 800}
    )
    cost = prefix_affinity.choose(view, RoutingRequest(MODEL, 4_000, 1_000)).cost
    assert cost is not None
    assert (cost.node_id, cost.matched_tokens, cost.uncached_tokens, cost.total_ms) == (2, 800, 200, 0.0)


REGIONAL = (make_node(1), make_node(2, region="eu-central"), make_node(3, region="eu-central"))


def choose_local(candidates, load: dict[int, int], matched: dict[int, int]) -> int:
    view = RoutingView(
        region="us-east",
        candidates=candidates,
        params=PrefixAffinityParams(scope="local"),
        load={node_id: NodeLoad(count, 0) for node_id, count in load.items()},
        matched_tokens=matched,
    )
    return prefix_affinity.choose(view, RoutingRequest(MODEL, 4_000, 1_000)).node.id


def test_local_scope_stays_in_the_gateways_region_whatever_the_cache_and_load_abroad() -> None:
    # The prompt is cached abroad and the local node is the busiest: a regional router still
    # never sees the other regions' nodes.
    assert choose_local(REGIONAL, load={1: 90, 2: 0, 3: 0}, matched={2: 1_000}) == 1


def test_local_scope_fails_over_abroad_only_when_no_local_node_is_eligible() -> None:
    # Eligibility removed us-east's node (unhealthy): the other regions' nodes count, as geo-DNS
    # failover sends the region's clients elsewhere.
    assert choose_local(REGIONAL[1:], load={2: 5, 3: 0}, matched={2: 1_000}) == 2


def test_global_scope_is_the_default_and_follows_the_cache_abroad() -> None:
    assert PrefixAffinityParams().scope == "global"
    view = RoutingView(
        region="us-east",
        candidates=REGIONAL,
        params=PrefixAffinityParams(),
        load={1: NodeLoad(0, 0)},
        matched_tokens={2: 1_000},
    )
    assert prefix_affinity.choose(view, RoutingRequest(MODEL, 4_000, 1_000)).node.id == 2
