"""Prefix affinity: the SGLang router's cache-aware policy, over gorgo's prefix index.

As SGLang's ``CacheAwarePolicy.select_worker`` (sgl-router ``policies/cache_aware.rs``):

1. Load is outstanding requests per node (this gateway plus its peers). The fleet is *imbalanced*
   when both ``max - min > balance_abs_threshold`` and ``max > min * balance_rel_threshold``;
   then the least-loaded node wins, whatever the cache says.
2. Otherwise the node with the longest prefix match wins if its match ratio (matched / prompt
   tokens) is above ``cache_threshold``.
3. Otherwise (a miss) the least-loaded node wins.

One deliberate difference: on a miss SGLang picks the node with the smallest tree (the most free
cache), which ignores load and is the "death spiral" its PR #14305 describes; gorgo picks the
least-loaded node, as the issue's definition of this policy says. Matches come from
``ApproxPrefixIndex`` (chunks of ``CHUNK_BYTES`` bytes) instead of SGLang's character radix tree,
so the match length is rounded down to a chunk. The tree insert SGLang does inside
``select_worker`` is the gateway's ``PrefixIndex.insert`` after the decision.

``scope = "local"`` (the regional baseline): the candidates are cut to the gateway's region before
all of the above, and only when that region has no eligible node do the others count (failover
abroad), as a cache-aware router per region behind geo-DNS behaves.
"""

from __future__ import annotations

from typing import Final

from routing.algorithms import least_load
from routing.algorithms.base import AlgorithmInfo, Decision, NodeLoad, RoutingRequest, RoutingView
from routing.contract import CostTerms, PrefixAffinityParams

_DEFAULT_PARAMS: Final = PrefixAffinityParams()
_NO_LOAD: Final = NodeLoad()


def choose(view: RoutingView, request: RoutingRequest) -> Decision:
    """Least load when imbalanced; else the longest prefix match above the threshold; else least load."""
    params = view.params if isinstance(view.params, PrefixAffinityParams) else _DEFAULT_PARAMS
    if params.scope == "local":
        local = tuple(node for node in view.candidates if node.region == view.region)
        if local and len(local) < len(view.candidates):
            view = view.with_candidates(local)
    load_of = view.load.get
    loads = [load_of(node.id, _NO_LOAD).outstanding_requests for node in view.candidates]
    max_load = max(loads)
    min_load = min(loads)
    imbalanced = (
        max_load - min_load > params.balance_abs_threshold
        and max_load > min_load * params.balance_rel_threshold
    )
    prompt_tokens = max(0, request.prompt_tokens_est)
    if not imbalanced and prompt_tokens and view.matched_tokens:
        best_node = None
        best_key = (0, 0)
        for node, load in zip(view.candidates, loads, strict=True):
            matched = view.matched_tokens.get(node.id, 0)
            # Longest match; among equal matches the less loaded (SGLang leaves this to the tree).
            key = (matched, -load)
            if matched and (best_node is None or key > best_key):
                best_node, best_key = node, key
        if best_node is not None:
            matched = min(best_key[0], prompt_tokens)
            if matched / prompt_tokens > params.cache_threshold:
                return Decision(node=best_node, cost=_terms(best_node.id, matched, prompt_tokens))
    node = least_load.choose(view, request).node
    matched = min(view.matched_tokens.get(node.id, 0), prompt_tokens)
    return Decision(node=node, cost=_terms(node.id, matched, prompt_tokens))


def _terms(node_id: int, matched: int, prompt_tokens: int) -> CostTerms:
    # This policy values no time terms; it logs what it believed the node had cached.
    return CostTerms(node_id=node_id, matched_tokens=matched, uncached_tokens=prompt_tokens - matched)


INFO = AlgorithmInfo(
    params=PrefixAffinityParams,
    choose=choose,
    needs_prefix_matches=True,
)
