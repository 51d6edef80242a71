"""The shadow's decision beside the live one (issue 23): one more pure function call on the same view.

Algorithms are pure over an immutable view, so the shadow decides on exactly what the live policy
saw (candidates, load, RTT, live state, prefix matches, the request counter) with its own
parameters. Its candidates are the live view's when its guards are the live policy's (the usual
case, and the one that includes this gateway's breakers and admission), else its own eligible
nodes for the model. Both sides' predicted TTFT terms are logged: an algorithm that prices nothing
(round robin, least load, ...) is priced by the GORGO cost model for the node it chose, so the two
sides are compared on one model. A gorgo shadow on the live candidates prices that node from its
own evaluation of them (``gorgo.choose_and_price``: the terms gorgo gives the node there, so a
request both sides send to one node gets one prediction). A shadow that only moves gorgo's
weights reuses the live decision's per-node terms (``decide_with_shadow``). Nothing here touches
the index, the in-flight bookkeeping or the network: the shadow serves nothing.
"""

from __future__ import annotations

from typing import Final

from routing.algorithms import gorgo
from routing.algorithms.base import AlgorithmInfo, Decision, RoutingRequest, RoutingView
from routing.contract import AlgorithmParams, CostTerms, GorgoParams, NodeSpec
from routing.state.trials import TrialRoute

_PRICING_PARAMS: Final = GorgoParams()


class ShadowOutcome:
    """What the shadow would have done, and the live decision's terms when its algorithm gave none.

    A plain class with ``Final`` fields (compiled with this module: built and read directly, where
    a msgspec struct is a generic call per request).
    """

    __slots__ = ("cost", "live_cost", "node", "trial_id")

    def __init__(
        self,
        trial_id: int,
        node: NodeSpec | None,  # None: the shadow has no eligible node for the model
        cost: CostTerms | None,
        live_cost: CostTerms | None,  # None: the live decision's own cost terms stand
    ) -> None:
        self.trial_id: Final = trial_id
        self.node: Final = node
        self.cost: Final = cost
        self.live_cost: Final = live_cost

    def __repr__(self) -> str:
        return (
            f"ShadowOutcome(trial_id={self.trial_id!r}, node={self.node!r}, cost={self.cost!r}, "
            f"live_cost={self.live_cost!r})"
        )


def decide_with_shadow(
    algorithm: AlgorithmInfo,
    shadow: TrialRoute,
    view: RoutingView,
    request: RoutingRequest,
    *,
    live_view: bool,
) -> tuple[Decision, ShadowOutcome]:
    """The decision on ``view`` and the shadow's beside it.

    When the shadow only moves gorgo's weights (``TrialRoute.reweighs``) and ``view`` is the live
    policy's (``live_view``; not a canary's), gorgo's per-node terms are computed once and weighed
    twice (``gorgo.choose_twice``): a few multiplications per node instead of a second decision.
    """
    if live_view and shadow.reweighs:
        assert isinstance(shadow.params, GorgoParams)
        decision, shadowed = gorgo.choose_twice(view, request, shadow.params)
        return decision, ShadowOutcome(shadow.id, shadowed.node, shadowed.cost, None)
    decision = algorithm.choose(view, request)
    return decision, shadow_decision(shadow, view, request, decision, live_view=live_view)


def shadow_decision(
    shadow: TrialRoute, view: RoutingView, request: RoutingRequest, live: Decision, *, live_view: bool = True
) -> ShadowOutcome:
    """The shadow's choice on ``view`` (the live decision's view), priced like the live one.

    The issue's budget is 10 us a request, so no second ``RoutingView`` unless the shadow needs
    one (other candidates, or parameters its algorithm reads), gorgo without the runner-up the
    shadow does not log, and pricing through ``gorgo.price`` (one node, no view) unless a gorgo
    shadow evaluates the live candidates anyway (``gorgo.choose_and_price``).
    """
    priced = _priced(live)
    # The view's candidates are the shadow's only when they are the live policy's and its guards
    # are too: on a canary's request they are the canary's (its residency, not the shadow's).
    candidates = view.candidates if shadow.same_guards and live_view else shadow.candidates.get(request.model)
    params = shadow.params
    # type() is, not isinstance(): a msgspec struct's isinstance is a generic call, compiled.
    if not priced and candidates is view.candidates and type(params) is GorgoParams:
        decision, live_cost = gorgo.choose_and_price(view, request, params, live.node, _pricing(view))
        if live_cost is None:  # the live choice is not among the view's candidates (never on the path)
            live_cost = price(view, request, live.node)
        return ShadowOutcome(shadow.id, decision.node, decision.cost, live_cost)
    live_cost = None if priced else price(view, request, live.node)
    if not candidates:
        return ShadowOutcome(shadow.id, None, None, live_cost)
    if isinstance(params, GorgoParams):
        shadow_view = view if candidates is view.candidates else _beside(view, candidates, params)
        decision = gorgo.choose_with(shadow_view, request, params, runner_up=False)
        return ShadowOutcome(shadow.id, decision.node, decision.cost, live_cost)
    # Round robin and least load have no parameters: they decide on the live view as it is.
    if params.__struct_fields__ or candidates is not view.candidates:
        view = _beside(view, candidates, params)
    decision = shadow.algorithm.choose(view, request)
    cost = decision.cost if _priced(decision) else gorgo.price(view, request, decision.node, _PRICING_PARAMS)
    return ShadowOutcome(shadow.id, decision.node, cost, live_cost)


def price(view: RoutingView, request: RoutingRequest, node: NodeSpec) -> CostTerms:
    """The GORGO cost model's terms (rtt, queue, prefill) for ``node`` on ``view``: under the
    view's parameters when they are gorgo's, else under gorgo's defaults."""
    return gorgo.price(view, request, node, _pricing(view))


def _pricing(view: RoutingView) -> GorgoParams:
    """The parameters a side that prices nothing is priced under: the view's when they are
    gorgo's, else gorgo's defaults. (``type() is``: compiled, a msgspec struct's isinstance is a
    generic call.)"""
    params = view.params
    return params if type(params) is GorgoParams else _PRICING_PARAMS


def _beside(view: RoutingView, candidates: tuple[NodeSpec, ...], params: AlgorithmParams) -> RoutingView:
    """``view`` with other candidates and parameters: the same load, RTT, live state, matches,
    prefix rent and measured speeds (the live request's inputs, all of them)."""
    return RoutingView(
        view.region,
        candidates,
        params,
        view.load,
        view.rtt_ms,
        view.live,
        view.matched_tokens,
        view.sequence,
        view.gateway_id,
        view.prefix,
        view.ms_per_token,
    )


def _priced(decision: Decision) -> bool:
    return decision.cost is not None and decision.cost.node_id == decision.node.id
