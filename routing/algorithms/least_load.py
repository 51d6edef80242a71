"""Least load: the node with the fewest outstanding requests, then the fewest prefill tokens."""

from __future__ import annotations

from routing.algorithms.base import AlgorithmInfo, Decision, RoutingRequest, RoutingView
from routing.contract import LeastLoadParams


def choose(view: RoutingView, request: RoutingRequest) -> Decision:
    """Pick the least-loaded candidate; ties rotate with the request counter.

    Scanning starts at ``sequence mod n`` and only a strictly smaller load replaces the best, so
    equally idle nodes take turns instead of the lowest id getting every request at low load.
    """
    candidates = view.candidates
    count = len(candidates)
    start = view.sequence % count
    best = candidates[start]
    best_load = view.load_of(best.id)
    best_key = (best_load.outstanding_requests, best_load.outstanding_prefill_tokens)
    for offset in range(1, count):
        node = candidates[(start + offset) % count]
        load = view.load_of(node.id)
        key = (load.outstanding_requests, load.outstanding_prefill_tokens)
        if key < best_key:
            best, best_key = node, key
    return Decision(node=best)


INFO = AlgorithmInfo(params=LeastLoadParams, choose=choose)
