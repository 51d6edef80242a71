"""The algorithm interface: pure functions over an immutable view.

An algorithm gets a ``RoutingView`` (eligible candidates, their load, RTT from this gateway's
region, live state, the prefix matches the index found) and a ``RoutingRequest``, and returns a
``Decision``. It does no I/O and reads no clock: everything time- or state-dependent is in the
view, so every algorithm is testable with plain values and replayable in benchmarks.

Eligibility (model served, node active, healthy, data residency, maximum RTT) is decided before an
algorithm runs; an algorithm is never called with an empty candidate list.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import msgspec

from routing.contract import AlgorithmParams, CostTerms, NodeLiveState, NodeSpec, algorithm_name


@dataclass(frozen=True, slots=True)
class NodeLoad:
    """Outstanding work on a node as this gateway (plus its peers) knows it."""

    outstanding_requests: int = 0
    # prompt tokens sent but not yet at first token (prefill still to do)
    outstanding_prefill_tokens: int = 0
    # of outstanding_requests, those sent by gateways in the node's own region (its own clients'):
    # the arrivals a forward from another region would make wait (gorgo's displacement)
    home_requests: int = 0
    # prompt tokens the outstanding requests computed (or will compute) there, until they finish:
    # the KV cache they hold while they decode (gorgo's queue waits when a prompt does not fit)
    outstanding_context_tokens: int = 0


@dataclass(frozen=True, slots=True)
class RoutingRequest:
    """What an algorithm may know of the request."""

    model: str
    prompt_chars: int
    prompt_tokens_est: int
    session_key: str | None = None


@dataclass(frozen=True, slots=True)
class RoutingView:
    """An immutable picture of the fleet at the moment of one decision."""

    region: str  # the gateway's region
    candidates: tuple[NodeSpec, ...]  # eligible, in stable (id) order; never empty
    params: AlgorithmParams
    load: Mapping[int, NodeLoad] = field(default_factory=dict)  # node id -> load
    rtt_ms: Mapping[int, float] = field(default_factory=dict)  # node id -> RTT from `region`
    live: Mapping[int, NodeLiveState] = field(default_factory=dict)
    matched_tokens: Mapping[int, int] = field(default_factory=dict)  # node id -> cached prefix est.
    sequence: int = 0  # a per-gateway request counter (round robin)
    gateway_id: str = ""  # this gateway; lets cost ties spread differently on each gateway (gorgo)

    def load_of(self, node_id: int) -> NodeLoad:
        return self.load.get(node_id, _NO_LOAD)


_NO_LOAD = NodeLoad()


@dataclass(frozen=True, slots=True)
class Decision:
    """The chosen node and, where the algorithm models them, the cost terms.

    ``prediction`` (node, index mode, predicted cached tokens) is set by the gateway, only when the
    decision consulted the prefix index for this very request: the request record and the
    predicted-vs-actual metrics compare it with what the node reports.
    """

    node: NodeSpec
    cost: CostTerms | None = None
    runner_up: CostTerms | None = None
    prediction: tuple[int, str, int] | None = None


AlgorithmFn = Callable[[RoutingView, RoutingRequest], Decision]


@dataclass(frozen=True, slots=True)
class AlgorithmInfo:
    """A registered algorithm: its params struct (whose tag names it), its function, its label.

    ``label`` is what operators see (the control plane's choices); ``needs_prefix_matches`` tells
    the gateway to look the prompt up in the prefix index before calling ``choose``.
    """

    params: type[msgspec.Struct]
    choose: AlgorithmFn
    needs_prefix_matches: bool = False

    @property
    def label(self) -> str:
        return str(self.params.label)  # type: ignore[attr-defined]  # every params struct declares one

    @property
    def name(self) -> str:
        return algorithm_name(self.params)
