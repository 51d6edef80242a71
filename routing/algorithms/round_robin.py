"""Round robin: rotate over the eligible nodes in their stable (id) order."""

from __future__ import annotations

from routing.algorithms.base import AlgorithmInfo, Decision, RoutingRequest, RoutingView
from routing.contract import RoundRobinParams


def choose(view: RoutingView, request: RoutingRequest) -> Decision:
    """Pick candidate ``sequence mod n``: the gateway's request counter does the rotating.

    The rotation is over the candidates of this request's model, so with several models each sees
    an even spread only over time; that is the classic behaviour and good enough for a baseline.
    """
    candidates = view.candidates
    return Decision(node=candidates[view.sequence % len(candidates)])


INFO = AlgorithmInfo(params=RoundRobinParams, choose=choose)
